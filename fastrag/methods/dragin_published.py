"""DRAGIN on the engine, `fidelity: "published"`: the published code's loop and text rules (docs/published.md).

The same batched requests as reference mode (fastrag.methods.dragin): generations on the engine, the RIND and QFS
attention passes, spaCy on the text workers, searches batched; what differs is what the published code does with
their results (fastrag.methods.published): special tokens and a final EOS kept, raw token strings as words,
sentences found by substring search, its text joins, its query attention, its query round trip and padded passages.
"""

from __future__ import annotations

from fastrag.config import DraginConfig
from fastrag.data.exemplars import case_text, published_demo_text
from fastrag.data.metrics import ANSWER_MAX_TOKENS, answer_prompt, complete_answer, needs_answer_generation
from fastrag.methods import published as P
from fastrag.methods.common import FewShotMethod, generate, join, open_result, real_words, search, sentences, stop
from fastrag.loop.requests import AttnColmax, AttnRows, Parallel, RealWords, Sentences
from fastrag.trace import Round

PLAIN, RAG = 0, None  # KV branches, as in reference mode (fastrag.methods.dragin)


def with_end(g) -> tuple[list[int], list[float]]:
    """A generation's ids and entropies with the EOS that ended it put back (the published code keeps it)."""
    if g.ended_by_eos and g.end_id is not None:
        return list(g.ids) + [g.end_id], list(g.entropy) + [g.end_entropy]
    return list(g.ids), list(g.entropy)


class DraginPublished(FewShotMethod):
    """Policy factory: `policy(example)` returns the generator the scheduler drives."""

    name = "dragin"
    cfg: DraginConfig

    def __init__(self, cfg: DraginConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self.demos = published_demo_text(cfg.dataset, cfg.fewshot)
        self.spell = P.TokenSpelling.of(tokenizer)

    def __call__(self, ex):
        return self.run(ex)

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def run(self, ex):
        cfg, tok = self.cfg, self.tok
        q = ex.question
        res = open_result(ex)
        case = case_text(q, cfg.dataset)
        L = cfg.generate_max_length
        text = ""
        while True:
            old_len = len(text)
            g = yield from generate(res, self.demos + join(case, text), L, branch=PLAIN)
            ids, entropy = with_end(g)
            new_text = self.decode(ids)
            hit = None
            if ids:
                a, *sents = yield Parallel([AttnColmax(ids)] + ([Sentences(new_text)] if new_text.strip() else []))
                res.prefill_tokens += len(ids)
                hit = yield from self.rind(ids, entropy, a, [s.text for s in sents[0]] if sents else [])
            if hit is None:
                res.rounds.append(Round())
                text = P.plain_join(text, new_text)
            else:
                all_text = P.qfs_text(q, text, hit.kept, hit.words)
                rows_ids = tok.encode(all_text)
                rows, real = yield Parallel([AttnRows(rows_ids), RealWords(all_text)])
                res.prefill_tokens += len(rows_ids)
                query = self.qfs(rows_ids, rows, hit, real)
                docs = yield from search(res, P.search_query(tok, query, cfg.max_query_tokens), cfg.retrieve_topk)
                res.rounds.append(Round(trigger_sentence=hit.text,
                                        hit_words=[w for w, h in zip(hit.words, hit.hits) if h],
                                        query=query, doc_ids=[d.id for d in docs], sentence_words=hit.words,
                                        kept=hit.kept))
                passages = P.pad_passages([d.text for d in docs], cfg.retrieve_topk)
                prompt = self.demos + P.context_block(passages) + join(case, text, hit.kept.strip())
                g = yield from generate(res, prompt, L, branch=RAG)
                first = yield from sentences(self.decode(with_end(g)[0]))
                text = join(text.strip(), hit.kept.strip(), first[0].text if first else "")
            if stop(text, old_len, len(tok.encode(text)), L):
                break
        res.text = text
        if needs_answer_generation(text):  # the published evaluator's extra short generation
            g = yield from generate(res, answer_prompt(self.demos, case, text), ANSWER_MAX_TOKENS)
            text = complete_answer(text, self.decode(with_end(g)[0]))
        res.prediction = text
        return res

    def rind(self, ids, entropy, a, sents):
        """`hit = yield from self.rind(...)`: the published `modifier` (None: no sentence triggers)."""
        if not sents:
            return None
        tokens = self.tok.convert_ids_to_tokens(ids)
        spans = P.word_spans(tokens, ids, self.spell)
        words = P.word_texts(tokens, spans, self.spell)
        wa = [sum(a[l:r]) for l, r in spans]
        we = [sum(entropy[l:r]) / (r - l) for l, r in spans]
        found = P.rind(sents, words, wa, we, self.cfg.hallucination_threshold)
        if found is None:
            return None
        sid, (tl, tr), flags = found
        if self.cfg.check_real_words:
            flags = P.filter_real(words[tl:tr], flags, (yield from real_words(sents[sid])))
        return P.Hit(sentence=sid, text=sents[sid], kept=" ".join(sents[:sid]), words=words[tl:tr], hits=flags)

    def qfs(self, ids, rows, hit: P.Hit, real: set[str]) -> str:
        tokens = self.tok.convert_ids_to_tokens(ids)
        spans = P.word_spans(tokens, ids, self.spell, after_eos=False)
        words = P.word_texts(tokens, spans, self.spell)
        return P.qfs_select(words, P.qfs_word_attention(rows, spans), len(hit.words), hit.hits, real,
                            self.cfg.retrieve_keep_top_k)
