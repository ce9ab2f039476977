"""Per-question ETC oracle: docs/methods.md ("ETC") on plain transformers, one question at a time.

Every generation re-prefills its whole prompt through `model.generate` and stops at the first token holding a newline
(the published stop string); every judged line runs one more forward over the prompt and the line to read the last
layer's attention. The rule is written again here from the description, with backward searches where the engine's
policy (fastrag.methods.etc) keeps running indices, so that the two are checked against each other.
"""

from __future__ import annotations

import math
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from fastrag.data.exemplars import case_text
from fastrag.oracle import decisions as D
from fastrag.oracle.dragin import DraginOracle, join
from fastrag.text.realwords import matches_real_word, real_words
from fastrag.text.sentences import first_sentence, split_sentences
from fastrag.text.words import assign_words_to_sentences, sentence_word_ranges
from fastrag.trace import QuestionResult, Round


class NewlineStop(StoppingCriteria):
    def __init__(self, tok, start: int):
        self.tok, self.start = tok, start

    def __call__(self, input_ids, scores, **kw):
        return input_ids.shape[1] > self.start and "\n" in self.tok.decode([int(input_ids[0, -1])])


def trend_by_search(h: list[float], content: list[bool]) -> list[float]:
    """M per word, each difference found by searching backwards from the word (the published description)."""
    n = len(h)
    d1 = [0.0] * n
    for i in range(1, n):
        if content[i]:
            j = next((j for j in range(i - 1, -1, -1) if content[j]), None)
            if j is not None:
                d1[i] = h[i] - h[j]
    d2 = [0.0] * n
    for i in range(2, n):
        if content[i]:
            j = next((j for j in range(i - 1, 0, -1) if d1[j] != 0.0), None)
            if j is not None:
                d2[i] = d1[i] - d1[j]
    nz = [i for i in range(n) if d2[i] != 0.0]
    m = [0.0] * n
    for c, i in enumerate(nz):
        mean = sum(d2[k] for k in nz[: c + 1]) / (c + 1)
        prev = d2[nz[c - 1]] if c > 0 else 0.0
        num, den = abs(prev - mean), abs(d2[i] - mean) + abs(prev - mean)
        a = 0.9 + 0.1 * (num / den if den else math.nan)
        m[i] = a * d2[i] + (1.0 - a) * prev
    return m


class EtcOracle(DraginOracle):
    """ETC: `run(qid, question, gold) -> QuestionResult`; config: fastrag.methods.etc.EtcConfig."""

    @torch.no_grad()
    def line(self, prompt: str) -> tuple[list[int], torch.Tensor, bool, bool]:
        """(ids up to the first newline token included, their entropies, ended by EOS, cut at a newline)."""
        ids = self.encode(prompt)
        x = torch.tensor([ids], device=self.model.device)
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                  max_new_tokens=self.config.generate_max_length, do_sample=False,
                                  output_scores=True, return_dict_in_generate=True, pad_token_id=self._pad_id,
                                  stopping_criteria=StoppingCriteriaList([NewlineStop(self.tokenizer, len(ids))]))
        new = out.sequences[0, len(ids):].tolist()
        ent = D.token_entropy(torch.stack([s[0] for s in out.scores]).cpu()) if new else torch.zeros(0)
        self._prefill += len(ids)
        self._calls += 1
        ended = bool(new) and new[-1] in self.eos_ids
        if ended:
            new, ent = new[:-1], ent[:-1]
        self._decode += len(new)
        cut = bool(new) and "\n" in self.tokenizer.decode([new[-1]])
        return new, ent, ended, cut

    @torch.no_grad()
    def rows(self, ids: list[int]) -> torch.Tensor:
        return self.last_layer_attention(ids).to(torch.float64).mean(0)  # [T, T]

    def run(self, qid: str, question: str, gold: list[str]) -> QuestionResult:
        if not question.strip():
            raise ValueError("empty question")
        t0 = time.perf_counter()
        self._prefill = self._decode = self._calls = 0
        cfg, tok = self.config, self.tokenizer
        case = case_text(question, cfg.dataset)
        text, rounds = "", []
        while True:
            old_len = len(text)
            prompt = self.demos + join(case, text)
            ids, ent, ended, cut = self.line(prompt)
            if len(ids) + (ended and not cut) <= 1:
                break
            found = self.judge(question, prompt, case, text, ids, ent)
            if found is None:
                rounds.append(Round())
                text = join(text, tok.decode(ids, skip_special_tokens=True).strip())
                break
            cur, rnd = found
            docs = self.retriever.search([rnd.query], k=cfg.retrieve_topk)[0]
            rnd.doc_ids = [str(d.id) for d in docs]
            rounds.append(rnd)
            ctx = "".join(f"[{i}] {d.text}\n" for i, d in enumerate(docs, 1))
            rag = (self.demos + ("Context:\n" + ctx + "Answer in the same format as before.\n" if docs else "")
                   + join(case, cur))
            ids2, _, ended2, cut2 = self.line(rag)
            new2 = tok.decode(ids2, skip_special_tokens=True)
            first = first_sentence(new2)
            text = join(cur, first)
            if ended2 and not cut2 and len(first) >= len(new2.strip()):
                break
            if len(self.encode(text)) > cfg.generate_max_length or len(text) <= old_len:
                break
        prediction = self.answer(question, text)
        return QuestionResult(qid=qid, question=question, gold=list(gold), text=text, prediction=prediction,
                              rounds=rounds, prefill_tokens=self._prefill, decode_tokens=self._decode,
                              wall_s=time.perf_counter() - t0, llm_calls=self._calls)

    def judge(self, question, prompt, case, text, ids, ent):
        cfg, tok = self.config, self.tokenizer
        line = tok.decode(ids, skip_special_tokens=True)
        sents = split_sentences(line)
        if not sents:
            return None
        enc = tok(prompt, return_offsets_mapping=True)
        pids, offs = list(enc["input_ids"]), enc["offset_mapping"]
        P = len(pids)
        spans = self.words.spans(ids)
        words = self.words.texts(ids, spans)
        real = real_words(line)
        content = [matches_real_word(w, real) if cfg.check_real_words else True for w in words]
        h = [float(ent[l:r].max()) for l, r in spans]
        m = trend_by_search(h, content)
        A = self.rows(pids + ids)  # [T, T]
        W = len(spans)
        # word-by-token rows, then word-by-word attention among the line's words
        wr = torch.zeros(W, A.shape[1], dtype=torch.float64)
        for w, (l, r) in enumerate(spans):
            wr[w] = A[P + l: P + r].mean(0)
        ww = torch.zeros(W, W, dtype=torch.float64)
        for w, (l, r) in enumerate(spans):
            ww[:, w] = wr[:, P + l: P + r].sum(1)
        att = (ww / (wr.sum(1, keepdim=True) + 1e-10)).max(1).values
        ranges = sentence_word_ranges(assign_words_to_sentences(line, words, sents), len(sents))
        for si, (l, r) in enumerate(ranges):
            if r <= l:
                continue
            a = att[l:r] * (r - l) / (att[l:r].sum() + 1e-10)
            v = a * torch.tensor(m[l:r], dtype=torch.float64)
            hit = (v.abs() if cfg.thres_abs else v) > cfg.hallucination_threshold
            if not bool(hit.any()):
                continue
            st = l + int(hit.nonzero()[0])
            hit_rows = [l + int(i) for i in hit.nonzero().flatten() if l + int(i) >= st]
            cur = join(text, tok.decode(ids[: spans[st][0]], skip_special_tokens=True).strip())
            query = self.etc_query(question, prompt, case, text, pids, offs, wr, spans, words, st, hit_rows, line)
            return cur, Round(trigger_sentence=sents[si].text, hit_words=[words[i] for i in hit_rows], query=query)
        return None

    def etc_query(self, question, prompt, case, text, pids, offs, wr, spans, words, st, hit_rows, line):
        P = len(pids)
        pspans = self.words.spans(pids)
        pwords = self.words.texts(pids, pspans)
        q_lo = len(self.demos) + case.rindex(question)
        regions = [(q_lo, q_lo + len(question))] + ([(len(self.demos) + len(case) + 1, len(prompt))] if text else [])
        cols = []
        for lo, hi in regions:
            for (l, r), w in zip(pspans, pwords):
                if lo <= offs[l][1] - 1 < hi:
                    cols.append((l, r, w))
        cols += [(P + l, P + r, words[i]) for i, (l, r) in enumerate(spans[:st])]
        real = real_words(prompt + line)
        score = wr[hit_rows].sum(0)
        cand = [(i, float(score[l:r].sum())) for i, (l, r, w) in enumerate(cols) if matches_real_word(w, real)]
        cand.sort(key=lambda c: -c[1])  # stable: ties keep text order
        keep = sorted(i for i, _ in cand[: self.config.retrieve_keep_top_k])
        return self.truncate_query(" ".join(cols[i][2] for i in keep))
