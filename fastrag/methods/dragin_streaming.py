"""DRAGIN `streaming` mode (docs/architecture.md "Two DRAGIN modes"): the paper's rules at engine speed.

Reference mode decodes L tokens per round, judges the sentences afterwards and throws away everything after a
trigger; after a retrieval it decodes L more tokens to keep one sentence. Streaming decodes in chunks of
`stream_chunk_tokens` and judges each sentence as soon as the next one starts (or the round ends):
- RIND of a sentence uses the tokens generated so far in the round; `H_t` comes from the decode itself, and `a_t`
  (config `stream_attention`) by default from the decode too: the engine tracks, for every token of the round,
  the largest last-layer attention (per head, then the mean over heads) it has received from any later query
  decoded so far, in context (the prompt's keys are in the softmax), with the fused attention-statistics kernel
  on the decode attention's row log-sum-exp — no extra forward. `"pass"` instead runs reference mode's attention
  pass over the round's tokens up to the sentence end (positions from 0), one per judged sentence;
- a trigger cuts the round at the sentence start: the next prompt is the truncated text, so the engine frees the
  KV blocks after it (longest-common-prefix restart) and nothing past the trigger is decoded;
- after a retrieval, decoding stops as soon as the first sentence is complete;
- a round also ends at the sentence that contains the stop phrase (reference mode would decode on to L tokens).
QFS, the retrieval prompt and the stop rule are reference mode's (fastrag.methods.dragin).

Continuing a chunk re-sends the round's prompt plus the round's token ids as they are (`Generate.suffix_ids`); the
engine reuses the sequence's own cache for all of it, so a chunk boundary costs one fed token, not a prefill.
"""

from __future__ import annotations

from fastrag.config import (ConfigError, DraginStreamingConfig, dragin_config, load_dragin_config,
                            read_json_object)
from fastrag.methods.common import (STOP_PHRASE, finish_answer, first_sentence, generate, join, real_words, search,
                                    sentences, token_char_ends)
from fastrag.methods.dragin import DraginReference
from fastrag.methods.registry import MethodSpec, register
from fastrag.methods.token_rag import token_spans
from fastrag.loop.requests import AttnColmax, AttnRows, Parallel, RealWords
from fastrag.text.realwords import matches_real_word
from fastrag.text.words import assign_words_to_sentences, sentence_word_ranges
from fastrag.trace import Round

PLAIN, RAG = 0, 1


class DraginStreaming(DraginReference):
    name = "dragin-streaming"

    def judge(self, ids, text, a, entropy, si):
        """`found = yield from self.judge(...)`: RIND of sentence `si` of `text` (= decode(ids)): (sentences, words,
        hits) if a word hits, else None."""
        spans = self.words.spans(ids)
        words = self.words.texts(ids, spans)
        sents = yield from sentences(text)
        ranges = sentence_word_ranges(assign_words_to_sentences(text, words, sents), len(sents))
        if si >= len(ranges):
            return None
        l, r = ranges[si]
        if r <= l:
            return None
        aw = [sum(a[x:y]) for x, y in spans[l:r]]
        hw = [sum(entropy[x:y]) / (y - x) for x, y in spans[l:r]]
        tot = sum(aw)
        hits = [(w / tot if tot > 0 else 0.0) * h * (r - l) > self.cfg.hallucination_threshold
                for w, h in zip(aw, hw)]
        if not any(hits):
            return None
        if self.cfg.check_real_words:
            real = yield from real_words(sents[si].text)
            hits = [h and matches_real_word(w, real) for h, w in zip(hits, words[l:r])]
        return sents, words[l:r], hits

    def run(self, ex):
        cfg, tok = self.cfg, self.tok
        q = ex.question
        res, case = self.open(ex)
        L, chunk = cfg.generate_max_length, cfg.stream_chunk_tokens
        text = ""
        while True:
            old_len = len(text)
            base = self.demos + join(case, text)
            ids, ent = [], []  # the round's generated tokens and their entropies
            judged, ended, trig, stop_here = 0, False, None, False
            in_context = cfg.stream_attention == "in-context"
            while not ended:
                g = yield from generate(res, base, min(chunk, L - len(ids)), PLAIN, suffix_ids=tuple(ids),
                                        track_attn=in_context)
                ids += g.ids
                ent += g.entropy
                ended = g.ended_by_eos or len(ids) >= L or not g.ids
                new_text = tok.decode(ids, skip_special_tokens=True)
                sents = yield from sentences(new_text)
                complete = len(sents) if ended else max(len(sents) - 1, 0)
                if complete <= judged:
                    continue
                ends = token_char_ends(tok, ids)
                tspans = token_spans(ends, sents)
                for si in range(judged, complete):
                    upto = tspans[si][1]
                    if in_context:
                        a = g.attn[:upto]
                    else:
                        a = yield AttnColmax(ids[:upto])
                        res.prefill_tokens += upto
                    sub = tok.decode(ids[:upto], skip_special_tokens=True)
                    found = yield from self.judge(ids[:upto], sub, a, ent[:upto], si)
                    if found is not None:
                        trig = (sents, si, found)
                        break
                    if STOP_PHRASE in (sents[si].text.lower() if cfg.stop_case_insensitive else sents[si].text):
                        stop_here = True
                        sents = sents[: si + 1]
                        break
                judged = complete
                if trig is not None or stop_here:
                    break
            if trig is None:
                res.rounds.append(Round())
                kept_text = join(*[s.text for s in sents]) if stop_here else new_text.strip()
                text = join(text, kept_text)
            else:
                sents, si, (_, words, hits) = trig
                kept = join(*[s.text for s in sents[:si]])
                all_text = join(q, text, kept) + " " + " ".join(w for w in words if w)
                rows_ids = tok.encode(all_text)
                rows, real = yield Parallel([AttnRows(rows_ids), RealWords(all_text)])
                res.prefill_tokens += len(rows_ids)
                query = self.qfs(all_text, rows_ids, rows, words, hits, real)  # truncated to max_query_tokens
                docs = yield from search(res, query, cfg.retrieve_topk)
                res.rounds.append(Round(trigger_sentence=sents[si].text,
                                        hit_words=[w for w, h in zip(words, hits) if h],
                                        query=query, doc_ids=[str(d.id) for d in docs]))
                ctx = "".join(f"[{i}] {d.text}\n" for i, d in enumerate(docs, 1))
                rag_base = (self.demos + "Context:\n" + ctx + "Answer in the same format as before.\n"
                            + join(case, text, kept))
                rids: list[int] = []
                while True:  # decode until the first sentence is complete
                    g = yield from generate(res, rag_base, min(chunk, L - len(rids)), RAG, suffix_ids=tuple(rids))
                    rids += g.ids
                    rtext = tok.decode(rids, skip_special_tokens=True)
                    if g.ended_by_eos or len(rids) >= L or not g.ids or len((yield from sentences(rtext))) > 1:
                        break
                text = join(text, kept, (yield from first_sentence(rtext)))
            stop_text = text.lower() if cfg.stop_case_insensitive else text
            if len(tok.encode(text)) > L or len(text) <= old_len or STOP_PHRASE in stop_text:
                break
        return (yield from finish_answer(res, tok, self.demos, case, text))


def _config(dataset: str, path: str | None) -> DraginStreamingConfig:
    raw = read_json_object(path) if path is not None else None  # (read once: the mode check needs the file's own)
    cfg = load_dragin_config(path, dataset=dataset, more_keys=frozenset({"stream_chunk_tokens", "stream_attention"}),
                             raw=raw) if path is not None else dragin_config(dataset)
    # (a file without "mode": streaming)
    if raw is not None and raw.get("mode", "streaming") != "streaming":
        raise ConfigError(f"{path}: field 'mode' is {cfg.mode!r}; --method dragin-streaming runs streaming mode "
                          "(reference mode is --method dragin)")
    values = {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}
    chunk = values["extra"].pop("stream_chunk_tokens", 16)
    attention = values["extra"].pop("stream_attention", "in-context")
    values["mode"] = "streaming"
    try:
        return DraginStreamingConfig(**values, stream_chunk_tokens=chunk, stream_attention=attention)
    except ConfigError as e:  # (the streaming options are read here, after load_dragin_config named the file)
        raise ConfigError(f"{path}: {e}") from None


register(MethodSpec(
    name="dragin-streaming", description="DRAGIN, streaming mode: each sentence judged as it ends, KV cut at the "
    "trigger, no throw-away decoding", make_config=_config, make_policy=DraginStreaming))
