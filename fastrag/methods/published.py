"""The published DRAGIN code's text rules, as its code computes them (`fidelity: "published"`, docs/published.md).

`reference` mode implements the paper's rules as we read them; users judge fidelity against the published code
(`src/generate.py` of oneal2000/DRAGIN), whose outputs differ wherever its code departs from that reading. This module
holds those departures as pure functions over token strings, ids and plain float lists, so that the engine's policy
(fastrag.methods.dragin_published) and the per-question oracle (fastrag.oracle.dragin_published) apply the same
text rules; the model-side work (generation, entropies, the attention passes) stays separate in each.

What the published code does that reference mode does not:
- Special tokens stay. A generation that ends with EOS keeps the EOS token: in its text (decoded without skipping
  special tokens, so "<|im_end|>" is written into the answer and fed back in later prompts, where the tokenizer reads
  it as the special token again), among its words, and in its entropies and attention. The loop goes on after it.
- Words are raw token strings: the tokens of a word (a token starts one when it is the first, starts with the
  tokenizer's word-start marker, is the newline token, or follows "</s>") are joined as the tokenizer spells them
  and only the marker is removed, so a newline stays "Ċ" (byte-level BPE) and "é" stays "Ã©".
- Sentences are found among the words by substring search (`align_sentences`): a sentence is the shortest run of
  words from where the previous one ended whose " "-join contains it; a sentence that never appears (one with a
  newline inside, written "Ċ" among the words) gets no words, and the last sentence takes every word left.
- Text is joined by two rules: after a plain round `text.strip() + " " + new.strip()` (a leading space when text
  was empty, and a trailing one when the new text is blank: the text still grows, so the loop goes on); after a
  retrieval the non-empty parts with one space.
- The query's attention (`qfs_query`): the text `question + " " + text + " " + kept + " " + words` (empty parts
  kept, so spaces double), re-tokenised; each word's row is the mean over its tokens i of the row of token i - 1
  restricted to the columns before the word and renormalised there (the first token of the text has none); the
  hit words' rows are averaged and each candidate scored by its columns' sum. The hit flags are matched to the
  re-tokenised text's last words by count, as published (Python's negative indexing included).
- The retriever's query is the formulated query's last `max_query_tokens` tokens decoded without special tokens,
  always (the round trip drops "<|im_end|>" even from a short query); a search with fewer hits than asked for is
  padded with empty passages ("[3] \\n" in the prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fastrag.methods.common import INSTRUCTION, INSTRUCTION_TYPO, join
from fastrag.text.realwords import matches_real_word

Span = tuple[int, int]  # [l, r) token range of a word
LLAMA2_EOS = "</s>"  # the published merge starts a word after this token string (Llama-2's EOS), whatever the model


@dataclass(frozen=True, slots=True)
class TokenSpelling:
    """How the published code spells one tokenizer's tokens: its word-start marker and its newline token id."""

    space: str  # "Ġ" (byte-level BPE) or "▁" (SentencePiece)
    newline_id: int | None

    @classmethod
    def of(cls, tok) -> "TokenSpelling":
        # The published code hard-codes Llama-2's "▁" and newline id 13; the tokenizer's own spelling of " " and
        # of "\n" are the same facts for any tokenizer.
        pieces = tok.tokenize(" ")
        space = "Ġ" if any("Ġ" in p for p in pieces) else "▁"
        nl = tok.encode("\n", add_special_tokens=False)
        return cls(space=space, newline_id=nl[-1] if nl else None)


def word_spans(tokens: Sequence[str], ids: Sequence[int], sp: TokenSpelling, after_eos: bool = True) -> list[Span]:
    """Published token -> word merge. after_eos: a token after "</s>" starts a word (the generation's merge has
    this test, the query pass's merge has not)."""
    out: list[list[int]] = []
    for i, t in enumerate(tokens):
        if i == 0 or t.startswith(sp.space) or ids[i] == sp.newline_id or (after_eos and tokens[i - 1] == LLAMA2_EOS):
            out.append([i, i + 1])
        else:
            out[-1][1] += 1
    return [(l, r) for l, r in out]


def word_texts(tokens: Sequence[str], spans: Sequence[Span], sp: TokenSpelling) -> list[str]:
    return ["".join(tokens[l:r]).replace(sp.space, "") for l, r in spans]


def align_sentences(sentences: Sequence[str], words: Sequence[str]) -> list[Span]:
    """[tl, tr) word range of each sentence, by the published substring search (module docstring)."""
    out: list[Span] = []
    tid = 0
    for sid, sent in enumerate(sentences):
        tl = tr = tid
        if sid == len(sentences) - 1:
            tr = len(words)
        else:
            for i in range(tid + 1, len(words)):
                if sent in " ".join(words[tl:i]):
                    tr = i
                    break
            tid = tr
        out.append((tl, tr))
    return out


@dataclass(slots=True)
class Hit:
    """The published `modifier`'s answer for a generation that triggers retrieval."""

    sentence: int  # index of the triggering sentence
    text: str  # that sentence
    kept: str  # ptext: the sentences before it, joined with " "
    words: list[str]  # the sentence's words (curr_tokens)
    hits: list[bool]  # their hit flags, after the real-word filter


def rind(sentences: Sequence[str], words: Sequence[str], word_attn: Sequence[float], word_entropy: Sequence[float],
         threshold: float) -> tuple[int, Span, list[bool]] | None:
    """First sentence with a word whose `attn / sum(attn) * entropy * n_words > threshold`: (index, span, flags).

    As published, a sentence without words scores nothing, and a sentence whose attention sums to zero divides by
    zero: its scores are NaN (or inf), and NaN > threshold is false.
    """
    for sid, (tl, tr) in enumerate(align_sentences(sentences, words)):
        if tr <= tl:
            continue
        total = sum(word_attn[tl:tr])
        n = tr - tl
        flags = [_ratio(word_attn[i], total) * word_entropy[i] * n > threshold for i in range(tl, tr)]
        if any(flags):
            return sid, (tl, tr), flags
    return None


def _ratio(a: float, total: float) -> float:
    """a / total with numpy's float semantics (0/0 is NaN, a/0 is inf), which the published code divides by."""
    if total != 0:
        return a / total
    return math.nan if a == 0 else math.copysign(math.inf, a)


def filter_real(words: Sequence[str], flags: Sequence[bool], real: set[str]) -> list[bool]:
    """check_real_words: a hit survives on a word that some real word of the sentence is a substring of."""
    return [bool(f) and matches_real_word(w, real) for w, f in zip(words, flags)]


def qfs_text(question: str, text: str, kept: str, words: Sequence[str]) -> str:
    """The text of the published query pass (empty parts keep their spaces)."""
    return question + " " + text + " " + kept + " " + " ".join(words)


def qfs_word_attention(m: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
    """[W, W] word-to-word attention of the published query pass; m: [T, T] head-mean last-layer attention.

    Row w: for each token i of w but the text's first, the row of token i - 1 over the columns before w's first
    token, renormalised to sum 1 there; their sum divided by w's token count, then summed per word of columns.
    """
    m = m.to(torch.float64)
    T = m.shape[0]
    W = len(spans)
    out = torch.zeros(W, W, dtype=torch.float64)
    col_word = torch.empty(T, dtype=torch.long)
    for w, (l, r) in enumerate(spans):
        col_word[l:r] = w
    for w, (l, r) in enumerate(spans):
        att = torch.zeros(T, dtype=torch.float64)
        for i in range(l, r):
            if i == 0:
                continue
            v = m[i - 1, :l]
            att[:l] += v / v.sum()
        att /= r - l
        out[w].index_add_(0, col_word, att)
    return out


def qfs_select(words: Sequence[str], word_att: torch.Tensor, n_curr: int, curr_hits: Sequence[bool],
               real: set[str], top_k: int) -> str:
    """The published `keep_real_words` selection over the query pass's words.

    n_curr: the count of the sentence's words written at the end of the text (their flags are `curr_hits`); the
    published code places them at `len(words) - n_curr`, whatever the re-tokenisation made of them.
    """
    W = len(words)
    curr_st = W - n_curr
    fwd = torch.zeros(W, dtype=torch.float64)
    hit_cnt = 0
    for i, h in enumerate(curr_hits):
        if h:
            fwd += word_att[_py_index(curr_st + i, W)]
            hit_cnt += 1
    fwd = fwd / hit_cnt if hit_cnt else torch.full((W,), math.nan, dtype=torch.float64)
    scores = fwd.tolist()
    pairs = []
    for i, w in enumerate(words):
        if i >= curr_st and curr_hits[i - curr_st]:
            continue
        if matches_real_word(w, real):
            pairs.append((scores[i], w, i))
    k = min(top_k, len(pairs))
    # Python's sort is stable under reverse=True; with NaN scores (no hit word) no comparison is true, so the text
    # order stays, as in the published code
    pairs = sorted(pairs, key=lambda x: x[0], reverse=True)[:k]
    pairs.sort(key=lambda x: x[2])
    return " ".join(p[1] for p in pairs)


def _py_index(i: int, n: int) -> int:
    """Python list indexing of a length-n list (negative indices count from the end); IndexError past it."""
    if not -n <= i < n:
        raise IndexError(f"hit word index {i} outside the query pass's {n} words")
    return i % n


def search_query(tok, query: str, max_tokens: int) -> str:
    """The published retriever's query: the last max_tokens tokens (no special tokens added), decoded without
    special tokens."""
    ids = tok.encode(query, add_special_tokens=False)[-max_tokens:]
    return tok.decode(ids, skip_special_tokens=True)


def pad_passages(texts: Sequence[str], k: int) -> list[str]:
    """The retrieved passages' texts padded with empty passages to k, as the published retriever does."""
    return list(texts) + [""] * (k - len(texts))


def context_block(texts: Sequence[str], typo: bool = False) -> str:
    """The published context block of the passages' texts (padded ones included)."""
    return "Context:\n" + "".join(f"[{i}] {t}\n" for i, t in enumerate(texts, 1)) + \
        (INSTRUCTION_TYPO if typo else INSTRUCTION)


def plain_join(text: str, new: str) -> str:
    """The published text after a round without retrieval."""
    return text.strip() + " " + new.strip()


def _solve(solver: str, xs: list[float]) -> float:
    """numpy's mean / max / min as the published TokenRAG calls them: the mean of nothing is NaN (no trigger); the
    max or min of nothing raises, as it does there."""
    if not xs:
        if solver == "avg":
            return math.nan
        raise ValueError(f"the published TokenRAG takes the {solver} of no token probabilities (a sentence after the "
                         "last token) and fails there")
    return {"avg": lambda v: sum(v) / len(v), "max": max, "min": min}[solver](xs)


def token_modifier(sentences: Sequence[str], tokens: Sequence[str], logprobs: Sequence[float], threshold: float,
                   solver: str) -> tuple[str, str] | None:
    """The published TokenRAG `modifier`: (kept text, the trigger sentence with its uncertain tokens written
    "[xxx]") of the first sentence whose tokens' solver(1 - p) exceeds threshold, or None.

    tokens: each generated token decoded alone (special tokens kept), logprobs: their log-probabilities. A sentence's
    tokens are found by `str.find` from the previous sentence's end: the search position restarts from the match's
    offset within the remaining slice (as published), and the range is taken one token past the last found.
    """
    tid = 0
    for sid, sent in enumerate(sentences):
        pos, tr = 0, tid
        while tr < len(tokens):
            apr = sent[pos:].find(tokens[tr])
            if apr == -1:
                break
            pos = apr + len(tokens[tr])
            tr += 1
        probs = [1 - math.exp(v) for v in logprobs[tid:tr + 1]]
        if _solve(solver, probs) > threshold:
            curr, pos = sent, 0
            for prob, tok in zip(probs, tokens[tid:tr + 1]):
                apr = curr[pos:].find(tok) + pos
                if prob > threshold:
                    curr = curr[:apr] + "[xxx]" + curr[apr + len(tok):]
                    pos = apr + len("[xxx]")
                else:
                    pos = apr + len(tok)
            return ("" if sid == 0 else " ".join(sentences[:sid])), curr
        tid = tr + 1
    return None


def token_query(formulation: str, question: str, text: str, kept: str, curr: str) -> str:
    """The published TokenRAG's query: "direct" (the sentence without its uncertain tokens) or "forward_all"."""
    return curr.replace("[xxx]", "") if formulation == "direct" else join(question, text, kept)
