"""ETC, Entropy-Trend Constraint (Li et al., AAAI 2026): retrieve where the generated words' entropy starts rising
sharply, read from its first and second differences (docs/methods.md, "ETC").

Per round (the rules as the published code computes them, written here from its description in docs/methods.md):
  1. Generate one line (demos + case + text; the generation is cut after its first newline token, the published
     stop string). A line of at most one token (the newline alone) ends the loop.
  2. Words: the DRAGIN word merge of the line's tokens; word entropy H_w = the largest entropy of its tokens.
     Content words: those containing a spaCy real word of the line (NOUN/ADJ/VERB/PROPN/NUM).
  3. `entropy_trend`: first difference d1 (a content word minus the previous content word), second difference d2
     (d1 minus the previous non-zero d1) and its dynamic smoothing M (see there).
  4. Word attention a_w: in one forward over the prompt and the line, the largest attention the word pays to any
     word of the line (last layer, head mean, token rows averaged and columns summed per word). Per sentence,
     a_w is rescaled to mean 1; a word hits when a_w * M_w > theta (|.| > theta with thres_abs). The first
     sentence with a hit triggers at its first hit word.
  5. Query: real words of the question and of the text before the trigger word, ranked by the attention the hit
     words (from the trigger word to the sentence end) pay them in that forward, top retrieve_keep_top_k, in text
     order.
  6. The text keeps everything before the trigger word; the retrieval prompt's line is generated and its first
     sentence appended. Without a trigger the line is appended and the question is done (the published loop ends
     there); the loop also ends when the text passes L tokens or stops growing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastrag.config import (CONFIG_DEFAULTS, RagConfig, check_bools, check_int, check_number, method_config,
                            rag_defaults)
from fastrag.loop.requests import AttnRows, Parallel, RealWords, Sentences
from fastrag.methods.common import FewShotMethod, finish_answer, generate, join, rag_prompt, search, truncate_query
from fastrag.methods.registry import MethodSpec, register
from fastrag.text.realwords import matches_real_word
from fastrag.text.words import assign_words_to_sentences, sentence_word_ranges, word_boundaries
from fastrag.trace import Round

# plain prompts extend each other on branch 0; a retrieval prompt's line is decoded in chunks too, so it keeps a
# sequence of its own (branch 1) while its chunks extend it
PLAIN, RAG = 0, 1
LINE_CHUNK = 16  # tokens decoded between two looks for the line's newline
ETC_THRESHOLD = 1.3  # the published config's hallucination_threshold (its only released config, IIRC)
ETC_TOP_K = 35  # the published config's retrieve_keep_top_k


@dataclass(slots=True)
class EtcConfig(RagConfig):
    """ETC's fields (besides RagConfig's L, exemplars and documents per retrieval)."""

    hallucination_threshold: float = ETC_THRESHOLD  # theta: a word hits when a_w * M_w > theta
    retrieve_keep_top_k: int = ETC_TOP_K  # words kept in the query
    thres_abs: bool = False  # published option: compare |a_w * M_w| with theta
    # only content words take part in the differences (the published code always filters; False: every word)
    check_real_words: bool = True

    def __post_init__(self) -> None:
        RagConfig.__post_init__(self)
        # (below 0 a word with a flat entropy trend, a_w * M_w = 0, would hit)
        check_number(self, "hallucination_threshold", 0.0)
        check_int(self, "retrieve_keep_top_k", 1)
        check_bools(self, "thres_abs", "check_real_words")


def etc_defaults(dataset: str):
    # the published ETC retriever sends the query whole: 512 tokens is no cut for a query of at most 35 words
    return EtcConfig, {**rag_defaults(dataset), "hallucination_threshold": ETC_THRESHOLD,
                       "retrieve_keep_top_k": ETC_TOP_K, "max_query_tokens": 512}


CONFIG_DEFAULTS["etc"] = etc_defaults


# ---------------------------------------------------------------------------------------------- the rule


def entropy_trend(h: list[float], content: list[bool]) -> tuple[list[float], list[float], list[float]]:
    """(d1, d2, M) per word from word entropies `h` and the content flags (0.0 where a word has none).

    d1[i] = h[i] - h[j], j the previous content word (i content, j exists).
    d2[i] = d1[i] - d1[k], k the previous word with d1[k] != 0 (i content, k exists).
    M over the non-zero d2 in order: with E the running mean of the non-zero d2 so far (this one included) and p the
    previous non-zero d2 (0 at first), w = |p - E| / (|d2 - E| + |p - E|), alpha = 0.9 + 0.1 w,
    M = alpha d2 + (1 - alpha) p. p is the previous raw d2, not the previous M (as published). 0/0 gives NaN,
    which never hits.
    """
    n = len(h)
    d1, d2, m = [0.0] * n, [0.0] * n, [0.0] * n
    prev_content = prev_d1 = None
    for i in range(n):
        if not content[i]:
            continue
        if prev_content is not None:
            d1[i] = h[i] - h[prev_content]
        if prev_d1 is not None:
            d2[i] = d1[i] - d1[prev_d1]
        prev_content = i
        if d1[i] != 0.0:
            prev_d1 = i
    total, count, p = 0.0, 0, 0.0
    for i in range(n):
        if d2[i] == 0.0:
            continue
        count += 1
        total += d2[i]
        mean = total / count
        den = abs(d2[i] - mean) + abs(p - mean)
        w = abs(p - mean) / den if den > 0 else math.nan
        alpha = 0.9 + 0.1 * w
        m[i] = alpha * d2[i] + (1 - alpha) * p
        p = d2[i]
    return d1, d2, m


def sentence_hits(att: list[float], m: list[float], threshold: float, use_abs: bool) -> list[bool]:
    """Hits of one sentence's words: `a_w * len / (sum a + 1e-10) * M_w > threshold` (|.| with use_abs)."""
    scale = len(att) / (sum(att) + 1e-10)
    v = [a * scale * x for a, x in zip(att, m)]
    return [abs(x) > threshold if use_abs else x > threshold for x in v]


def first_trigger(att: list[float], m: list[float], ranges, threshold: float, use_abs: bool):
    """The first sentence (word ranges `ranges`) with a hit: (its index, the trigger word = its first hit word, the
    hit flags of its words from the trigger word on); None when no sentence has one."""
    for si, (lo, hi) in enumerate(ranges):
        if hi <= lo:
            continue
        hits = sentence_hits(att[lo:hi], m[lo:hi], threshold, use_abs)
        if any(hits):
            st = lo + hits.index(True)
            return si, st, hits[st - lo:]
    return None


def cut_line(tok, ids: list[int], entropy: list[float]) -> tuple[list[int], list[float], bool]:
    """The tokens up to and including the first one whose text holds a newline (the published stop string), their
    entropies, and whether such a token was found."""
    for t, i in enumerate(ids):
        if "\n" in tok.decode([i]):
            return ids[: t + 1], entropy[: t + 1], True
    return list(ids), list(entropy), False


def word_attention(rows: torch.Tensor, start: int, spans) -> torch.Tensor:
    """[W, T] per generated word: its tokens' attention rows (positions start + span) averaged, in word columns
    summed later by the caller. rows: [T, T] head-mean last-layer attention over the prompt and the line."""
    return torch.stack([rows[start + l: start + r].mean(0) for l, r in spans])


def region_words(spans, offsets, lo: int, hi: int) -> list[int]:
    """Indices of the prompt words whose first token's last character lies in [lo, hi)."""
    return [w for w, (l, _) in enumerate(spans) if lo <= offsets[l][1] - 1 < hi]


def generate_line(res, tok, prompt: str, limit: int, branch: int):
    """`ids, entropy, cut, eos = yield from generate_line(...)`: one line of at most `limit` tokens, decoded in chunks
    of LINE_CHUNK tokens that resume the sequence (Generate.suffix_ids) until a token holds a newline (kept, the
    rest of its chunk dropped), an EOS ends it (dropped) or `limit` tokens are out. Greedy decoding makes it the
    line a generation stopped at the newline gives, without decoding L tokens past it."""
    ids: list[int] = []
    ent: list[float] = []
    while True:
        g = yield from generate(res, prompt, min(LINE_CHUNK, limit - len(ids)), branch, suffix_ids=tuple(ids))
        ids, ent = ids + list(g.ids), ent + list(g.entropy)
        ids, ent, cut = cut_line(tok, ids, ent)
        if cut or g.ended_by_eos or len(ids) >= limit or not g.ids:
            return ids, ent, cut, g.ended_by_eos and not cut


class Etc(FewShotMethod):
    name = "etc"
    cfg: EtcConfig

    def __init__(self, cfg: EtcConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.words = word_boundaries(tokenizer)

    def __call__(self, ex):
        cfg, tok = self.cfg, self.tok
        res, case = self.open(ex)
        text = ""
        while True:
            old_len = len(text)
            prompt = self.demos + join(case, text)
            ids, ent, cut, eos = yield from generate_line(res, tok, prompt, cfg.generate_max_length, PLAIN)
            if len(ids) + eos <= 1:  # the published "empty generation" (an EOS counts as its token): done
                break
            line = tok.decode(ids, skip_special_tokens=True)
            trig = yield from self.judge(ex.question, prompt, case, text, ids, ent, line, res)
            if trig is None:
                res.rounds.append(Round())
                text = join(text, line.strip())
                break  # (the published loop ends after a line without a trigger)
            cur, rnd = trig
            docs = yield from search(res, rnd.query, cfg.retrieve_topk)
            rnd.doc_ids = [str(d.id) for d in docs]
            res.rounds.append(rnd)
            ids2, _, _, eos2 = yield from generate_line(res, tok, rag_prompt(self.demos, docs, case, cur),
                                                           cfg.generate_max_length, RAG)
            new2 = tok.decode(ids2, skip_special_tokens=True)
            sents2 = (yield Sentences(new2)) if new2.strip() else []
            first = sents2[0].text if sents2 else ""
            text = join(cur, first)
            if eos2 and len(first) >= len(new2.strip()):
                break
            if len(tok.encode(text)) > cfg.generate_max_length or len(text) <= old_len:
                break
        return (yield from finish_answer(res, tok, self.demos, case, text))

    def judge(self, question, prompt, case, text, ids, ent, line, res):
        """`trig = yield from self.judge(...)`: None, or (the text kept before the trigger word, its Round with the
        query)."""
        cfg, tok = self.cfg, self.tok
        enc = tok(prompt, return_offsets_mapping=True)
        pids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        spans = self.words.spans(ids)
        words = self.words.texts(ids, spans)
        parts = [AttnRows(pids + list(ids)), RealWords(line)] + ([Sentences(line)] if line.strip() else [])
        rows, real, *sents = yield Parallel(parts)
        res.prefill_tokens += len(pids) + len(ids)
        sents = sents[0] if sents else []
        if not sents:
            return None
        P = len(pids)
        content = [matches_real_word(w, real) or not cfg.check_real_words for w in words]
        h = [max(ent[l:r]) for l, r in spans]
        _, _, m = entropy_trend(h, content)
        wa = word_attention(rows, P, spans)  # [W, T]
        new_cols = torch.stack([wa[:, P + l: P + r].sum(-1) for l, r in spans], dim=-1)  # [W, W]
        att = (new_cols / (wa.sum(-1, keepdim=True) + 1e-10)).max(dim=-1).values.tolist()
        ranges = sentence_word_ranges(assign_words_to_sentences(line, words, sents), len(sents))
        found = first_trigger(att, m, ranges, cfg.hallucination_threshold, cfg.thres_abs)
        if found is None:
            return None
        si, st, hits = found
        partial = tok.decode(ids[: spans[st][0]], skip_special_tokens=True)
        cur = join(text, partial.strip())
        hit_rows = [st + i for i, hh in enumerate(hits) if hh]
        query = yield from self.query(question, prompt, case, text, pids, offsets, wa, spans, words, st,
                                      hit_rows, line)
        return cur, Round(trigger_sentence=sents[si].text, hit_words=[words[i] for i in hit_rows], query=query)

    def query(self, question, prompt, case, text, pids, offsets, wa, spans, words, st, hit_rows, line):
        """The real words of the question and of the text before the trigger word (prompt text and the line's words
        before it), the top retrieve_keep_top_k by the attention the hit words pay them, in text order."""
        cfg = self.cfg
        P = len(pids)
        pspans = self.words.spans(pids)
        pwords = self.words.texts(pids, pspans)
        q_lo = len(self.demos) + case.rindex(question)
        t_lo = len(self.demos) + len(case) + 1
        cols = [(pspans[w], pwords[w]) for w in region_words(pspans, offsets, q_lo,
                                                              q_lo + len(question))]
        if text:
            cols += [(pspans[w], pwords[w]) for w in region_words(pspans, offsets, t_lo,
                                                                  len(prompt))]
        cols += [((P + l, P + r), words[i]) for i, (l, r) in enumerate(spans[:st])]
        real = yield RealWords(prompt + line)
        fwd = wa[hit_rows].sum(0)  # [T]: the hit words' rows summed
        cand = [(float(fwd[l:r].sum()), i, w) for i, ((l, r), w) in enumerate(cols) if matches_real_word(w, real)]
        ranked = sorted(cand, key=lambda c: (-c[0], c[1]))[: cfg.retrieve_keep_top_k]
        q = " ".join(w for _, _, w in sorted(ranked, key=lambda c: c[1]))
        return truncate_query(self.tok, q, cfg.max_query_tokens)


def _oracle(hf_model, tokenizer, retriever, cfg):
    from fastrag.oracle.etc import EtcOracle

    return EtcOracle(hf_model, tokenizer, retriever, cfg)


register(MethodSpec(
    name="etc", description="ETC (AAAI 2026): retrieve where the smoothed second difference of word entropy, "
    "weighted by attention, passes a threshold",
    make_config=lambda dataset, path: method_config("etc", dataset, path),
    make_policy=Etc, make_oracle=_oracle))
