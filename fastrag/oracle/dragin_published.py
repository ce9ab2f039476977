"""Per-question DRAGIN oracle, `fidelity: "published"`: the published code's loop on plain transformers.

One question at a time, as the published code runs it: every round re-prefills its whole prompt through
`model.generate`, keeps the EOS that ends a generation (text decoded with special tokens), runs one extra forward over
the generated ids alone for the RIND attention, and one over the query text for the query's. The text rules are
fastrag.methods.published, shared with the engine's policy; what this module adds is the model side, computed the
straightforward way (eager attention probabilities, full-vocabulary softmax), so `fastrag parity` checks the
engine's batched passes and KV reuse in this mode.

It also answers single decisions for a replay of a published trace (fastrag.published_replay): `rind` on a given
generation and `query` on given words and hits.
"""

from __future__ import annotations

import time

import torch

from fastrag.data.exemplars import case_text, published_demo_text
from fastrag.data.metrics import ANSWER_MAX_TOKENS, answer_prompt, complete_answer, needs_answer_generation
from fastrag.methods import published as P
from fastrag.methods.common import join, stop
from fastrag.oracle import decisions as D
from fastrag.oracle.dragin import DraginOracle
from fastrag.text.realwords import real_words
from fastrag.text.sentences import split_sentences
from fastrag.trace import QuestionResult, Round


class DraginPublishedOracle(DraginOracle):
    """`run(qid, question, gold) -> QuestionResult`; model: a transformers causal LM (eager attention returns the
    probabilities; other implementations get the last layer's recomputed), tokenizer: its HF tokenizer, retriever:
    fastrag.retrieval.base.Retriever, config: a DraginConfig with fidelity "published"."""

    keep_end = True  # generations keep the EOS that ends them, in ids, entropies and text (DraginOracle.generate)

    def __init__(self, model, tokenizer, retriever, config):
        super().__init__(model, tokenizer, retriever, config)
        self.spell = P.TokenSpelling.of(tokenizer)

    def demo_text(self, config) -> str:
        return published_demo_text(config.dataset, config.fewshot)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ decisions

    def rind(self, ids: list[int], entropy) -> P.Hit | None:
        """The published `modifier` on one generation (ids with its EOS, their entropies)."""
        if not ids:
            return None
        sents = [s.text for s in split_sentences(self.decode(ids))]
        if not sents:
            return None
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        spans = P.word_spans(tokens, ids, self.spell)
        words = P.word_texts(tokens, spans, self.spell)
        a = D.token_attention(self.last_layer_attention(ids))
        h = torch.as_tensor(entropy, dtype=torch.float64)
        wa = [float(a[l:r].sum()) for l, r in spans]
        we = [float(h[l:r].sum()) / (r - l) for l, r in spans]
        found = P.rind(sents, words, wa, we, self.config.hallucination_threshold)
        if found is None:
            return None
        sid, (tl, tr), flags = found
        if self.config.check_real_words:
            flags = P.filter_real(words[tl:tr], flags, real_words(sents[sid]))
        return P.Hit(sentence=sid, text=sents[sid], kept=" ".join(sents[:sid]), words=words[tl:tr], hits=flags)

    def query(self, question: str, text: str, kept: str, words: list[str], hits: list[bool]) -> str:
        """The published `keep_real_words` query."""
        all_text = P.qfs_text(question, text, kept, words)
        ids = self.encode(all_text)
        m = self.last_layer_attention(ids).to(torch.float64).mean(dim=0)
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        spans = P.word_spans(tokens, ids, self.spell, after_eos=False)
        return P.qfs_select(P.word_texts(tokens, spans, self.spell), P.qfs_word_attention(m, spans), len(words),
                            hits, real_words(all_text), self.config.retrieve_keep_top_k)

    def search(self, query: str) -> list:
        k = self.config.retrieve_topk
        return list(self.retriever.search([P.search_query(self.tokenizer, query, self.config.max_query_tokens)],
                                          k=k)[0])

    # ------------------------------------------------------------------ one question

    def run(self, qid: str, question: str, gold: list[str]) -> QuestionResult:
        if not question.strip():
            raise ValueError("empty question")
        t0 = time.perf_counter()
        self._prefill = self._decode = self._calls = 0
        cfg, L = self.config, self.config.generate_max_length
        case = case_text(question, cfg.dataset)
        text, rounds = "", []
        while True:
            old_len = len(text)
            gen = self.generate(self.demos + join(case, text), L)
            hit = self.rind(gen.ids, gen.entropy)
            if hit is None:
                rounds.append(Round())
                text = P.plain_join(text, gen.text)
            else:
                query = self.query(question, text, hit.kept, hit.words, hit.hits)
                docs = self.search(query)
                rounds.append(Round(trigger_sentence=hit.text, hit_words=[w for w, h in zip(hit.words, hit.hits) if h],
                                    query=query, doc_ids=[str(d.id) for d in docs], sentence_words=hit.words,
                                    kept=hit.kept))
                passages = P.pad_passages([d.text for d in docs], cfg.retrieve_topk)
                prompt = self.demos + P.context_block(passages) + join(case, text, hit.kept.strip())
                first = split_sentences(self.generate(prompt, L, scores=False).text)
                text = join(text.strip(), hit.kept.strip(), first[0].text if first else "")
            if stop(text, old_len, len(self.encode(text)), L):
                break
        prediction = text
        if needs_answer_generation(text):
            out = self.generate(answer_prompt(self.demos, case, text), ANSWER_MAX_TOKENS, scores=False)
            prediction = complete_answer(text, out.text)
        return QuestionResult(qid=qid, question=question, gold=list(gold), text=text, prediction=prediction,
                              rounds=rounds, prefill_tokens=self._prefill, decode_tokens=self._decode,
                              wall_s=time.perf_counter() - t0, llm_calls=self._calls)
