"""DRAGIN on the engine, `reference` mode (docs/dragin-reference.md).

Each question runs as a generator over engine requests, so its code reads like the per-question rules while the
scheduler batches every question's generations, attention passes and searches. The decision steps (RIND scoring,
QFS selection) work on host lists of at most a few hundred numbers; the heavy parts are the batched passes.
"""

from __future__ import annotations

import math

import torch

from fastrag.config import DraginConfig
from fastrag.data.metrics import ANSWER_MAX_TOKENS, answer_prompt, complete_answer, needs_answer_generation
from fastrag.methods.common import (FewShotMethod, first_sentence, generate, join, real_words, search, sentences,
                                    truncate_query)
from fastrag.loop.requests import AttnColmax, AttnRows, Parallel, RealWords, Sentences
from fastrag.text.realwords import matches_real_word
from fastrag.text.words import assign_words_to_sentences, sentence_word_ranges, word_boundaries
from fastrag.trace import Round


# KV sequences of one question: plain-round prompts (demos + case + text) extend each other, so their branch keeps
# reusing its own cache. A retrieval prompt (demos + docs + case + text) runs on a one-shot sequence (branch None),
# released when its generation ends: each round's documents differ, so a kept cache would be reused for a few
# tokens while it held the documents' KV between rounds, which the other questions' admissions wait for. The prefix
# cache still shares the full blocks a later prompt repeats. Measured on 12 HotpotQA questions (SmolLM2, CPU, the
# same answers and queries either way): 13,078 prefilled tokens against 12,984 with a kept branch (+0.7%).
PLAIN, RAG = 0, None


class DraginReference(FewShotMethod):
    """Policy factory: `policy(example, seq)` returns the generator the scheduler drives."""

    name = "dragin"
    cfg: DraginConfig

    def __init__(self, cfg: DraginConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.words = word_boundaries(tokenizer)

    def __call__(self, ex):
        return self.run(ex)

    # ------------------------------------------------------------------ one question
    def run(self, ex):
        cfg, tok = self.cfg, self.tok
        q = ex.question
        res, case = self.open(ex)
        text = ""
        while True:
            old_len = len(text)
            g = yield from generate(res, self.demos + join(case, text), cfg.generate_max_length)
            new_text = tok.decode(g.ids, skip_special_tokens=True)
            a, sents = [], []
            if g.ids:  # the attention pass and the sentence split at once (neither needs the other)
                a, *sents = yield Parallel([AttnColmax(g.ids)] + ([Sentences(new_text)] if new_text.strip() else []))
                sents = sents[0] if sents else []
                res.prefill_tokens += len(g.ids)
            trig = yield from self.rind(g.ids, new_text, a, g.entropy, sents)
            if trig is None:
                res.rounds.append(Round())
                text = join(text, new_text.strip())
            else:
                sents, si, words, hits = trig
                kept = join(*[s.text for s in sents[:si]])
                all_text = join(q, text, kept) + " " + " ".join(w for w in words if w)
                rows_ids = tok.encode(all_text)
                rows, real = yield Parallel([AttnRows(rows_ids), RealWords(all_text)])
                res.prefill_tokens += len(rows_ids)
                query = self.qfs(all_text, rows_ids, rows, words, hits, real)
                docs = yield from search(res, query, cfg.retrieve_topk)
                res.rounds.append(Round(trigger_sentence=sents[si].text,
                                        hit_words=[w for w, h in zip(words, hits) if h],
                                        query=query, doc_ids=[d.id for d in docs]))
                ctx = "".join(f"[{i}] {d.text}\n" for i, d in enumerate(docs, 1))
                prompt = (self.demos + "Context:\n" + ctx + "Answer in the same format as before.\n"
                          + join(case, text, kept))
                g = yield from generate(res, prompt, cfg.generate_max_length, branch=RAG)
                text = join(text, kept, (yield from first_sentence(tok.decode(g.ids, skip_special_tokens=True))))
            stop_text = text.lower() if cfg.stop_case_insensitive else text
            if len(tok.encode(text)) > cfg.generate_max_length or len(text) <= old_len \
                    or "the answer is" in stop_text:
                break
        res.text = text
        if needs_answer_generation(text):  # the evaluator's one extra short generation (fastrag.data.metrics)
            g = yield from generate(res, answer_prompt(self.demos, case, text), ANSWER_MAX_TOKENS)
            text = complete_answer(text, tok.decode(g.ids, skip_special_tokens=True))
        res.prediction = text  # scored by fastrag.data.metrics.score (which extracts the answer)
        return res

    # ------------------------------------------------------------------ decisions
    def rind(self, ids, text, a, entropy, sents=None):
        """`trig = yield from self.rind(...)`: the first sentence with a word whose RIND score exceeds the
        threshold, or None (its spaCy work goes to the scheduler). sents: text's sentences, when already split.

        score_w = a_w / sum_{sentence} a * H_w * (#words in the sentence), a_w = sum of its tokens' attention,
        H_w = mean of its tokens' entropy (DRAGIN section 3.1, with the published code's word merging).
        """
        if not ids:
            return None
        if sents is None:
            sents = yield from sentences(text)
        if not sents:  # a blank generation (only whitespace or special tokens): no sentence, no trigger
            return None
        spans = self.words.spans(ids)
        words = self.words.texts(ids, spans)
        aw = [sum(a[l:r]) for l, r in spans]
        hw = [sum(entropy[l:r]) / (r - l) for l, r in spans]
        ranges = sentence_word_ranges(assign_words_to_sentences(text, words, sents), len(sents))
        for si, (l, r) in enumerate(ranges):
            if r <= l:
                continue
            tot = sum(aw[l:r])
            hits = [(aw[i] / tot if tot > 0 else 0.0) * hw[i] * (r - l) > self.cfg.hallucination_threshold
                    for i in range(l, r)]
            if any(hits):
                if self.cfg.check_real_words:
                    real = yield from real_words(sents[si].text)
                    hits = [h and matches_real_word(w, real) for h, w in zip(hits, words[l:r])]
                return sents, si, words[l:r], hits
        return None

    def qfs(self, all_text: str, ids, rows: torch.Tensor, curr_words, curr_hits, real: set[str]) -> str:
        """Query from the words the hit words attend to most (DRAGIN section 3.2), POS-filtered by `real`, the
        real words of all_text (fastrag.text.realwords.real_words)."""
        cfg = self.cfg
        spans = self.words.spans(ids)
        words = self.words.texts(ids, spans)
        att = torch.stack([rows[l:r].mean(0) for l, r in spans])  # [W, T] word rows
        norm = att[:, 1:].sum(-1, keepdim=True) if cfg.qfs_skip_first else att.sum(-1, keepdim=True)
        att = att / norm
        # all_text ends with the sentence's non-empty words (an empty word, a newline's, is not written there): the
        # hit flags line up with those
        flags = [h for w, h in zip(curr_words, curr_hits) if w]
        first_curr = len(words) - len(flags)
        hit_idx = [first_curr + i for i, h in enumerate(flags) if h and first_curr + i >= 0]
        cand = [i for i, w in enumerate(words) if matches_real_word(w, real) and i not in set(hit_idx)]
        k = cfg.retrieve_keep_top_k
        if hit_idx:
            fwd = att[hit_idx].mean(0)  # [T] mean attention of the hit words over token columns
            score = {i: float(fwd[spans[i][0]: spans[i][1]].sum()) for i in cand}
            ranked = sorted(cand, key=lambda i: (-score[i] if not math.isnan(score[i]) else math.inf, i))
            keep = sorted(ranked[:k])
        else:
            keep = cand[:k]
        return truncate_query(self.tok, " ".join(words[i] for i in keep), cfg.max_query_tokens)


def _dragin_config(dataset: str, path: str | None):
    from fastrag.config import dragin_config, load_dragin_config

    cfg = load_dragin_config(path, dataset=dataset) if path is not None else dragin_config(dataset)
    if cfg.mode != "reference":
        from fastrag.config import ConfigError

        raise ConfigError(f"{path}: field 'mode' is {cfg.mode!r}; --method dragin runs reference mode (streaming "
                          "mode is --method dragin-streaming)")
    return cfg


def _published_config(dataset: str, path: str | None):
    """--method dragin-published: a DRAGIN config (the published files as they are) run with fidelity "published"."""
    from dataclasses import replace

    from fastrag.config import ConfigError

    cfg = _dragin_config(dataset, path)
    if path is not None and cfg.fidelity != "published" and "fidelity" in _raw_keys(path):
        raise ConfigError(f"{path}: field 'fidelity' is {cfg.fidelity!r}, but --method dragin-published runs "
                          "fidelity 'published' (use --method dragin for reference mode)")
    try:
        return replace(cfg, fidelity="published")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None


def _raw_keys(path: str) -> set[str]:
    from fastrag.config import read_json_object

    return set(read_json_object(path))


def _policy(cfg, tokenizer):
    if cfg.fidelity == "published":
        from fastrag.methods.dragin_published import DraginPublished

        return DraginPublished(cfg, tokenizer)
    return DraginReference(cfg, tokenizer)


def _dragin_oracle(hf_model, tokenizer, retriever, cfg):
    if cfg.fidelity == "published":
        from fastrag.oracle.dragin_published import DraginPublishedOracle

        return DraginPublishedOracle(hf_model, tokenizer, retriever, cfg)
    from fastrag.oracle.dragin import DraginOracle

    return DraginOracle(hf_model, tokenizer, retriever, cfg)


from fastrag.methods.registry import MethodSpec, register  # noqa: E402

register(MethodSpec(
    name="dragin", description="DRAGIN: RIND over each full generation, QFS query (paper rules; config field "
    "fidelity: \"published\" for the published code's)",
    make_config=_dragin_config, make_policy=_policy, make_oracle=_dragin_oracle))
register(MethodSpec(
    name="dragin-published", description="DRAGIN as the published code computes it (special tokens kept, its word, "
    "sentence and query rules): --method dragin with fidelity \"published\"",
    make_config=_published_config, make_policy=_policy, make_oracle=_dragin_oracle))
