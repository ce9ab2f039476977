"""Per-question DRAGIN oracle: docs/dragin-reference.md on plain transformers, one question at a time.

This is the parity oracle and the speed baseline ("the published recipe"): every round re-prefills the full
prompt through `model.generate` (no prefix reuse), then runs one extra forward over the generated ids alone to
read the last-layer attention (RIND), and one forward over `question + text + kept + sentence words` for the
query (QFS). Batch size 1, the model as loaded: fp32 + eager attention for `output_attentions` as published, or
the tuned per-question configuration (bf16 on a GPU, SDPA), which returns no attention probabilities: the last
layer's are then recomputed from its input hidden state (`last_layer_probs`).

It shares no code with the engine: only the tokenizer, the retriever and the text utilities. The decision rules
themselves are the pure functions of `fastrag.oracle.decisions`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fastrag.data.exemplars import case_text, demo_text
from fastrag.data.metrics import ANSWER_MAX_TOKENS, answer_prompt, complete_answer, needs_answer_generation
from fastrag.oracle import decisions as D
from fastrag.oracle.context import check_context, eos_ids
from fastrag.text.realwords import matches_real_word, real_words
from fastrag.text.sentences import first_sentence, split_sentences
from fastrag.text.words import WordBoundaries, assign_words_to_sentences, sentence_word_ranges
from fastrag.trace import QuestionResult, Round

STOP_PHRASE = "the answer is"


@torch.no_grad()
def last_layer_probs(model, h: torch.Tensor) -> torch.Tensor:
    """Causal attention probabilities [H, T, T] (float32) of a Llama/Qwen2-family model's last layer, from that
    layer's input hidden state h [1, T, hidden] (`output_hidden_states[-2]`): what eager attention would return
    as `attentions[-1]`, for models run with fused attention (SDPA/flash), which never materialise it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer = model.model.layers[-1]
    attn = layer.self_attn
    if hasattr(attn, "q_norm"):
        raise ValueError("last_layer_probs supports Llama/Qwen2-style attention (no q/k norm)")
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    T = h.shape[1]
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(1, T, H, D).transpose(1, 2)
    k = attn.k_proj(x).view(1, T, Hkv, D).transpose(1, 2)
    cos, sin = model.model.rotary_emb(x, torch.arange(T, device=h.device)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * attn.scaling  # [1, H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)[0]


def join(*parts: str) -> str:
    """Join the non-empty strings among `parts` with one space (the contract's `join`)."""
    return " ".join(p for p in parts if p)


@dataclass(slots=True)
class Generation:
    """What one `model.generate` call produced (a final EOS already dropped, unless the oracle keeps it)."""

    ids: list[int]  # generated token ids, [N]
    text: str  # decode(ids, skip_special_tokens=True) (False when the oracle keeps the EOS)
    entropy: torch.Tensor  # [N] float64, H_t of the step that produced token t


class DraginOracle:
    """DRAGIN `reference` mode, straightforwardly: `run(qid, question, gold) -> QuestionResult`.

    model: a transformers causal LM whose forward accepts `output_attentions=True` (eager attention);
    tokenizer: its HF tokenizer; retriever: `fastrag.retrieval.base.Retriever`; config: `fastrag.config.DraginConfig`.
    """

    # keep the EOS that ends a generation in its ids, entropies and text (decoded with special tokens): the
    # published code's (fastrag.oracle.dragin_published); it is never counted as a decoded token
    keep_end = False

    def __init__(self, model, tokenizer, retriever, config):
        self.model = model
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.config = config
        self.eos_ids = eos_ids(tokenizer, model)
        self.words = WordBoundaries(tokenizer, eos_ids=self.eos_ids)
        self.demos = self.demo_text(config)
        self._pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids)
        self._prefill = 0
        self._decode = 0
        self._calls = 0  # generate calls of the current question (the record's llm_calls)

    def demo_text(self, config) -> str:
        return demo_text(config.dataset, config.fewshot)

    # ------------------------------------------------------------------ model calls

    def encode(self, text: str) -> list[int]:
        """The contract's `encode`: `tokenizer.encode` with the tokenizer's own special-token behaviour."""
        return self.tokenizer.encode(text)

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int, scores: bool = True) -> Generation:
        """Greedy `model.generate` on the full prompt (re-prefilled every call), no stop strings, ends at EOS.
        scores=False (the retrieval round's and the answer's generations, whose entropies no rule reads): no
        scores kept, as the published code keeps none there; Generation.entropy is then empty."""
        ids = self.encode(prompt)
        check_context(self.model, len(ids), max_new_tokens)
        input_ids = torch.tensor([ids], device=self.model.device)  # [1, P]
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=scores,
            return_dict_in_generate=True,
            pad_token_id=self._pad_id,
        )
        new = out.sequences[0, len(ids):].tolist()  # [N]
        entropy = D.token_entropy(torch.stack([s[0] for s in out.scores]).cpu()) if scores and new else torch.zeros(0)
        self._prefill += len(ids)
        self._calls += 1
        # A final EOS belongs to neither the text nor the signals (unless keep_end), nor to the decoded tokens
        # counted (the engine and the BeamSearchQA oracle count a generation without it too: the same count).
        ended = bool(new) and new[-1] in self.eos_ids
        if ended and not self.keep_end:
            new, entropy = new[:-1], entropy[: len(new) - 1]
        self._decode += len(new) - (ended and self.keep_end)
        text = self.tokenizer.decode(new, skip_special_tokens=not self.keep_end)
        return Generation(ids=new, text=text, entropy=entropy)

    @torch.no_grad()
    def last_layer_attention(self, ids: list[int]) -> torch.Tensor:
        """One forward over `ids` alone (positions from 0): last-layer attention [H, T, T]."""
        check_context(self.model, len(ids))
        input_ids = torch.tensor([ids], device=self.model.device)
        mask = torch.ones_like(input_ids)
        self._prefill += len(ids)
        if getattr(self.model.config, "_attn_implementation", "eager") == "eager":
            out = self.model(input_ids=input_ids, attention_mask=mask, output_attentions=True)
            return out.attentions[-1][0].cpu()
        out = self.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
        return last_layer_probs(self.model, out.hidden_states[-2]).cpu()

    # ------------------------------------------------------------------ prompts

    def plain_prompt(self, question: str, text: str) -> str:
        return self.demos + join(case_text(question, self.config.dataset), text)

    def retrieval_prompt(self, question: str, text: str, kept: str, docs) -> str:
        context = "".join(f"[{i}] {doc.text}\n" for i, doc in enumerate(docs, 1))
        return (self.demos + "Context:\n" + context + "Answer in the same format as before.\n"
                + join(case_text(question, self.config.dataset), text, kept))

    # ------------------------------------------------------------------ RIND and QFS

    def rind(self, gen: Generation):
        """(trigger sentence list, Trigger, word texts) or None when no sentence of `gen.text` hits."""
        if not gen.ids:
            return None
        spans = self.words.spans(gen.ids)
        words = self.words.texts(gen.ids, spans)
        a = D.token_attention(self.last_layer_attention(gen.ids))  # [N]
        aw, hw = D.word_values(a, gen.entropy, spans)
        sentences = split_sentences(gen.text)
        if not sentences:  # whitespace-only text: nothing to judge
            return None
        assign = assign_words_to_sentences(gen.text, words, sentences)
        ranges = sentence_word_ranges(assign, len(sentences))
        trig = D.rind_trigger(aw, hw, ranges, self.config.hallucination_threshold)
        if trig is None:
            return None
        l, r = trig.words
        if self.config.check_real_words:
            real = real_words(sentences[trig.sentence].text)
            trig.hits = D.clear_unreal_hits(words[l:r], trig.raw_hits, lambda w: matches_real_word(w, real))
        return sentences, trig, words

    def qfs(self, question: str, text: str, kept: str, curr: list[str], hits: list[bool]) -> str:
        """The `real_words` query: the kept-top-K real words of `all` most attended by the hit words."""
        all_text = join(question, text, kept) + " " + " ".join(w for w in curr if w)
        ids = self.encode(all_text)
        m = self.last_layer_attention(ids).to(torch.float64).mean(dim=0)  # [T, T]
        spans = self.words.spans(ids)
        words = self.words.texts(ids, spans)
        # The sentence's non-empty words (the only ones written into `all`) are its last words, aligned with their
        # hit flags; an empty word (a newline's) has no place there
        flags = [h for w, h in zip(curr, hits) if w]
        start = len(words) - len(flags)
        hit_words = [start + i for i, h in enumerate(flags) if h and start + i >= 0]
        rows = D.qfs_word_rows(m, spans, self.config.qfs_skip_first)
        scores = D.qfs_scores(rows, spans, hit_words)
        real = real_words(all_text)
        hit_set = set(hit_words)
        candidate = [matches_real_word(w, real) and i not in hit_set for i, w in enumerate(words)]
        return self.truncate_query(" ".join(D.select_query_words(words, candidate, scores,
                                                                 self.config.retrieve_keep_top_k)))

    def truncate_query(self, query: str) -> str:
        """The last max_query_tokens tokens of the query, as the published retriever cuts it: the query's own tokens
        (no BOS), decoded without special tokens."""
        ids = self.tokenizer.encode(query, add_special_tokens=False)
        return self.tokenizer.decode(ids[-self.config.max_query_tokens:], skip_special_tokens=True).strip()

    # ------------------------------------------------------------------ one question

    def _stop(self, text: str, old_len: int) -> bool:
        has_answer = STOP_PHRASE in (text.lower() if self.config.stop_case_insensitive else text)
        return len(self.encode(text)) > self.config.generate_max_length or len(text) <= old_len or has_answer

    def answer(self, question: str, text: str) -> str:
        """The text evaluation scores (`fastrag.data.metrics.score` extracts the answer after "the answer is").

        When the cleaned text lacks "the answer is", the published evaluator's one extra short generation:
        `demos + case + " " + clean(text) + " So the answer is "`, ANSWER_MAX_TOKENS greedy tokens, appended.
        """
        if not needs_answer_generation(text):
            return text
        case = case_text(question, self.config.dataset)
        gen = self.generate(answer_prompt(self.demos, case, text), ANSWER_MAX_TOKENS, scores=False)
        return complete_answer(text, gen.text)

    def run(self, qid: str, question: str, gold: list[str]) -> QuestionResult:
        """One question, the contract's loop. Each round appends a `Round` (empty when RIND did not trigger).

        prefill_tokens = sum of the prompt lengths given to `generate` plus the lengths of the RIND and QFS
        attention forwards; decode_tokens = tokens `generate` produced (a final EOS left out, as the engine counts).
        """
        if not question.strip():  # (as the engine's policy and the FLARE and BeamSearchQA oracles refuse it)
            raise ValueError("empty question")
        t0 = time.perf_counter()
        self._prefill = self._decode = self._calls = 0
        L = self.config.generate_max_length
        text, rounds = "", []
        while True:
            old_len = len(text)
            new = self.generate(self.plain_prompt(question, text), L)
            found = self.rind(new)
            if found is None:
                text = join(text, new.text.strip())
                rounds.append(Round())
            else:
                sentences, trig, words = found
                kept = join(*(s.text for s in sentences[:trig.sentence]))
                l, r = trig.words
                curr = words[l:r]
                query = self.qfs(question, text, kept, curr, trig.hits)
                docs = self.retriever.search([query], k=self.config.retrieve_topk)[0]
                out = self.generate(self.retrieval_prompt(question, text, kept, docs), L, scores=False)
                text = join(text, kept, first_sentence(out.text))
                rounds.append(Round(
                    trigger_sentence=sentences[trig.sentence].text,
                    hit_words=[w for w, h in zip(curr, trig.hits) if h],
                    query=query,
                    doc_ids=[str(d.id) for d in docs],
                ))
            if self._stop(text, old_len):
                break
        t_answer = time.perf_counter()
        prediction = self.answer(question, text)
        answer_s = time.perf_counter() - t_answer  # the published code runs this part afterwards, batched
        return QuestionResult(
            qid=qid, question=question, gold=list(gold), text=text, prediction=prediction, rounds=rounds,
            prefill_tokens=self._prefill, decode_tokens=self._decode, wall_s=time.perf_counter() - t0,
            llm_calls=self._calls, counters={"answer_generation_s": answer_s},
        )


def run_oracle(examples, oracle: DraginOracle, *, progress: bool = True, on_result=None) -> list[QuestionResult]:
    """Run the oracle over `examples` one by one (tqdm progress bar).

    examples: `fastrag.data.datasets.Example`s (qid, question, answers), or objects / dicts with `qid`, `question`
    and `gold` (or `answers`). A question that raises is recorded with `error` set and the loop goes on.
    on_result: optional callback per finished question.
    """
    from tqdm.auto import tqdm

    def get(ex, *keys):
        for k in keys:
            if isinstance(ex, dict) and k in ex:
                return ex[k]
            if not isinstance(ex, dict) and hasattr(ex, k):
                return getattr(ex, k)
        raise ValueError(f"example {ex!r:.80} has no field {' or '.join(keys)}")

    results = []
    for ex in tqdm(list(examples), desc="oracle", unit="q", disable=not progress):
        qid, question, gold = str(get(ex, "qid")), get(ex, "question"), list(get(ex, "gold", "answers"))
        t0 = time.perf_counter()
        try:
            res = oracle.run(qid, question, gold)
        except Exception as e:  # noqa: BLE001 - one bad question must not end the run
            res = QuestionResult(qid=qid, question=question, gold=gold, wall_s=time.perf_counter() - t0,
                                 error=f"{type(e).__name__}: {e}")
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results
