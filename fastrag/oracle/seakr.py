"""Per-question SeaKR-style oracle (docs/methods.md, "SeaKR") on plain transformers: batch 1, every generation
re-prefills its whole prompt and decodes token by token; the samples are drawn by the reference sampler
(fastrag.signals.reference.decode_signals_ref) with the keys the method names, each hidden state comes from one more
full forward over prompt + sample + EOS (a hook on the chosen decoder layer), and the eigen score from the
eigenvalues of the samples' Gram matrix in float64. The rule (fastrag.methods.seakr's docstring) is written out here
again; the prompts, the stop tokens, the answer pattern and the word split are the method's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fastrag.engine import sampling_key
from fastrag.loop.questions import stable_id
from fastrag.methods.common import join, rag_prompt
from fastrag.methods.seakr import DROPPED_QUERY_WORDS, answer_of, finite, stop_tokens, strip_word
from fastrag.oracle.context import check_context
from fastrag.oracle.greedy import GreedyOracle
from fastrag.signals.reference import decode_signals_ref
from fastrag.text.realwords import matches_real_word, real_words
from fastrag.text.words import word_boundaries
from fastrag.trace import Round


class SeakrOracle(GreedyOracle):
    def __init__(self, model, tokenizer, retriever, config):
        super().__init__(model, tokenizer, retriever, config)
        self.stops = stop_tokens(tokenizer)
        self.words = word_boundaries(tokenizer)
        self.layer = model.model.layers[config.hidden_layer]

    def run(self, qid: str, question: str, gold: list[str]):
        from types import SimpleNamespace

        key = stable_id(SimpleNamespace(qid=qid, question=question))
        return self.solved(qid, question, gold, lambda q, case, rounds: self.solve(q, case, rounds, key))

    def solve(self, question: str, case: str, rounds: list[Round], key: int) -> str:
        cfg = self.config
        steps, docs, searched, n = [], [], set(), 0
        while True:
            n += 1
            text, ids, lps, score = self.evaluate(rag_prompt(self.demos, docs, case, join(*steps)), key, n)
            if answer_of(text):
                steps.append(text)
                rounds.append(Round(uncertainty=finite(score)))
                break
            if text and score <= cfg.eigen_threshold:
                steps.append(text)
                rounds.append(Round(uncertainty=finite(score)))
            else:
                query = self.query(question, ids, lps, steps[-1] if steps else "")
                rnd = Round(trigger_sentence=text, query=query, uncertainty=finite(score))
                rounds.append(rnd)
                if query in searched:
                    break
                searched.add(query)
                _, found = self.retrieve(query)
                rnd.doc_ids = [str(d.id) for d in found]
                new = [d for d in found if str(d.id) not in {str(x.id) for x in docs}]
                if not new:
                    break
                best, best_score, best_text = None, math.inf, ""
                for i, d in enumerate(new):
                    t, _, _, s = self.evaluate(rag_prompt(self.demos, docs + [d], case, join(*steps)), key, n + 1 + i)
                    s = s if t else math.inf
                    if best is None or s < best_score:
                        best, best_score, best_text = d, s, t
                n += len(new)
                rnd.chosen_doc = str(best.id)
                docs.append(best)
                steps.append(best_text)
                if answer_of(best_text):
                    break
            if len(steps) >= cfg.max_reasoning_steps or len(docs) >= cfg.max_docs:
                break
        return join(*steps)

    # ---- model calls
    @torch.no_grad()
    def decode(self, prompt: str, sample: int | None) -> tuple[list[int], list[float], bool]:
        """Tokens up to and including the first stop token (an EOS ends it, dropped), at most step_max_tokens:
        greedy (sample None) or drawn with the method's sampling and key `sample`. (ids, log-probs, ended by EOS)."""
        cfg = self.config
        ids = self.tokenizer.encode(prompt)
        check_context(self.model, len(ids), cfg.step_max_tokens)
        self._prefill += len(ids)
        self._calls += 1
        x = torch.tensor([ids], device=self.model.device)
        out, lps, past = [], [], None
        while len(out) < cfg.step_max_tokens:
            o = self.model(input_ids=x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            logits = o.logits[:, -1].float()
            if sample is None:
                sig = decode_signals_ref(logits)
            else:
                k = torch.tensor([sampling_key(cfg.seed, sample, len(out)) & 0xFFFFFFFF])
                sig = decode_signals_ref(logits, temperature=cfg.sample_temperature, rng_keys=k,
                                         top_p=cfg.sample_top_p, top_k=cfg.sample_top_k)
            t = int(sig["chosen"][0])
            if t in self.eos_ids:
                return out, lps, True
            out.append(t)
            lps.append(float(sig["logprob"][0]))
            self._decode += 1
            if t in self.stops:
                break
            x = torch.tensor([[t]], device=self.model.device)
        return out, lps, False

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> np.ndarray:
        """The chosen layer's output (the residual stream after it) at the last of ids, one full forward."""
        got = []
        h = self.layer.register_forward_hook(lambda m, i, o: got.append((o[0] if isinstance(o, tuple) else o)[0, -1]))
        try:
            self.model(input_ids=torch.tensor([ids], device=self.model.device))
        finally:
            h.remove()
        self._prefill += len(ids)
        self._calls += 1
        return got[0].float().cpu().numpy().astype(np.float64)

    def evaluate(self, prompt: str, key: int, n: int):
        """(greedy step text, its ids, its log-probs, eigen score of the samples)."""
        cfg = self.config
        ids, lps, _ = self.decode(prompt, None)
        pids = self.tokenizer.encode(prompt)
        z = []
        for i in range(cfg.samples):
            s_ids, _, eos = self.decode(prompt, sampling_key(key, n, i))
            body = s_ids if eos or not s_ids or s_ids[-1] not in self.stops else s_ids[:-1]
            if not self.text(body).strip():
                continue
            keep = s_ids if eos else s_ids[:-1]
            z.append(self.hidden(pids + keep + [self.tokenizer.eos_token_id]))
        score = math.inf
        if len(z) >= 2:
            zm = np.stack(z)
            zm = zm - zm.mean(axis=1, keepdims=True)
            gram = zm @ zm.T + cfg.eigen_alpha * np.eye(len(z))
            score = float(np.log(np.linalg.eigvalsh(gram)).sum()) / len(z)
        return self.text(ids).strip(), ids, lps, score

    def query(self, question: str, ids, lps, previous: str) -> str:
        spans = self.words.spans(ids)
        sure = []
        for (l, r), w in zip(spans, self.words.texts(ids, spans)):
            w = strip_word(w)
            if w and (w in question or (previous and w in previous)
                      or max(1 - math.exp(v) for v in lps[l:r]) <= self.config.prob_threshold):
                sure.append(w)

        def content(text: str) -> str:
            real = real_words(text)
            return " ".join(w for w in text.split() if matches_real_word(w, real) and w not in DROPPED_QUERY_WORDS)

        return content(" ".join(sure)) or content(question)
