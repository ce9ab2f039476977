"""SeaKR-style retrieval (Yao et al., 2024, "SeaKR: Self-aware Knowledge Retrieval for Adaptive RAG"): retrieve when
the model's *internal* uncertainty about its next reasoning step is high, measured as the eigen score of the hidden
states of several sampled continuations, and pick among the retrieved documents the one the model is least uncertain
with (docs/methods.md, "SeaKR").

The signal is computed on the engine's device from the batch's own forward passes: each sampled continuation is one
row of the decode batch (its own sampling settings beside the greedy rows, `Generate.sampling`), and its hidden state
is kept by the prefill of one more token (`Generate.hidden_layer`), which reuses the sample's KV.

Per question (the rule; docs/methods.md says what is and is not the published code's):
  steps = [], docs = [], searched = {}
  loop:
    evaluate(prompt = demos + context(docs) + case + steps):
      the greedy step: tokens up to and including the first stop token (a token whose text holds a newline or
        ends with "."), at most step_max_tokens;
      `samples` sampled continuations of the same prompt (temperature, top_k, top_p; per-sample keys), the same stop;
      z_i = the residual stream after layer `hidden_layer` at the EOS fed in place of sample i's last token (after
        it when it ended with an EOS); samples with no text are left out;
      score = (1/k) logdet(Z J_d Z^T + alpha I_k), J_d = I_d - 1/d (each z centred over its d features).
    the step says "the answer is ..." (the published answer pattern) -> keep it, done
    the step is empty or score > eigen_threshold -> retrieval:
      drop the step; query = the step's words that are in the question, in the previous step, or whose least
      likely token has 1 - p <= prob_threshold, kept if a content word (spaCy POS) and not thus/answer/is/so; none ->
      the question's content words; a query already searched -> done;
      the top retrieve_topk documents not yet in docs each evaluated with docs + [it]; the one whose step has the
      lowest score (an empty step: +inf; ties: retrieval order) joins docs, its step is kept; none new -> done
    else keep the step
    done when steps >= max_reasoning_steps or docs >= max_docs
  the answer: the steps' text, with the evaluator's answer generation when it lacks "the answer is".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from fastrag.config import (CONFIG_DEFAULTS, ConfigError, RagConfig, check_int, check_number, check_unit,
                            is_finite_number, method_config, rag_defaults)
from fastrag.engine import SamplingParams, sampling_key
from fastrag.loop.questions import stable_id
from fastrag.loop.requests import Generate, Parallel
from fastrag.methods.common import FewShotMethod, account, finish_answer, join, rag_prompt, real_words, search, \
    truncate_query
from fastrag.methods.registry import MethodSpec, register
from fastrag.signals.checks import MIN_TEMPERATURE
from fastrag.text.realwords import matches_real_word
from fastrag.text.words import word_boundaries
from fastrag.trace import QuestionResult, Round

# the published defaults (its command line): 20 samples at temperature 1, top-k 50, top-p 0.9, 100 tokens; the hidden
# state of layer 15 (0-based: the middle of a 32-layer 7B model, and of SmolLM2-135M's 30); alpha 1e-3; a step is
# uncertain above -6.0; a query word is sure at 1 - p <= 0.1; at most 10 steps and 5 documents
SAMPLES, TEMPERATURE, TOP_K, TOP_P, STEP_TOKENS = 20, 1.0, 50, 0.9, 100
HIDDEN_LAYER, EIGEN_ALPHA, EIGEN_THRESHOLD, PROB_THRESHOLD = 15, 1e-3, -6.0, 0.1
MAX_STEPS, MAX_DOCS = 10, 5
DROPPED_QUERY_WORDS = frozenset({"thus", "answer", "is", "so"})  # the published query filter's stop list
_ANSWER = (re.compile(r"the answer is(?:\s*:\s*)?(.*?)[,.]", re.S), re.compile(r"[.?!]\s*([^?!]*?)\s+is the answer\b",
                                                                                re.S))


@dataclass(slots=True)
class SeakrConfig(RagConfig):
    """SeaKR's fields (besides RagConfig's L, exemplars and documents per retrieval)."""

    samples: int = SAMPLES
    sample_temperature: float = TEMPERATURE
    sample_top_k: int = TOP_K
    sample_top_p: float = TOP_P
    seed: int = 42
    step_max_tokens: int = STEP_TOKENS
    hidden_layer: int = HIDDEN_LAYER
    eigen_alpha: float = EIGEN_ALPHA
    eigen_threshold: float = EIGEN_THRESHOLD
    prob_threshold: float = PROB_THRESHOLD
    max_reasoning_steps: int = MAX_STEPS
    max_docs: int = MAX_DOCS

    def __post_init__(self) -> None:
        RagConfig.__post_init__(self)
        check_int(self, "samples", 2)  # (one sample has no spread: its eigen score is a constant)
        check_number(self, "sample_temperature", 0.0)
        if self.sample_temperature < MIN_TEMPERATURE:  # (the samples' spread is the signal)
            raise ConfigError(f"sample_temperature must be >= {MIN_TEMPERATURE:g}, got {self.sample_temperature!r}")
        check_int(self, "sample_top_k", 0)
        if not (is_finite_number(self.sample_top_p) and 0 < self.sample_top_p <= 1):
            raise ConfigError(f"sample_top_p must be a number in (0, 1], got {self.sample_top_p!r}")
        check_int(self, "seed", 0)
        check_int(self, "step_max_tokens", 1)
        check_int(self, "hidden_layer", 0)  # (the model's layer count is checked by the engine)
        check_number(self, "eigen_alpha", 0.0)
        if self.eigen_alpha == 0:  # (Z J Z^T is singular when the samples repeat or outnumber the features)
            raise ConfigError("eigen_alpha must be > 0, got 0")
        if not is_finite_number(self.eigen_threshold):
            raise ConfigError(f"eigen_threshold must be a finite number, got {self.eigen_threshold!r}")
        self.eigen_threshold = float(self.eigen_threshold)
        check_unit(self, "prob_threshold")
        check_int(self, "max_reasoning_steps", 1)
        check_int(self, "max_docs", 1)


def seakr_defaults(dataset: str):
    return SeakrConfig, {**rag_defaults(dataset)}


CONFIG_DEFAULTS["seakr"] = seakr_defaults


# ---------------------------------------------------------------------------------------------- the rule


def eigen_score(z: torch.Tensor, alpha: float) -> float:
    """(1/k) logdet(Z J_d Z^T + alpha I_k) of the k x d hidden states z (J_d = I - 1/d: each row centred over its
    features), on z's device. In float64: the published float32 logdet keeps few digits of the k - r eigenvalues
    near alpha when the samples span r < k directions (1e-4 off in the score of identical samples)."""
    z = z.double()
    zc = z - z.mean(dim=1, keepdim=True)
    k = z.shape[0]
    sigma = zc @ zc.T + alpha * torch.eye(k, dtype=z.dtype, device=z.device)
    return float(torch.linalg.slogdet(sigma)[1]) / k


def finite(x: float) -> float | None:
    """x, or None when it is not finite (a record's JSON has no infinity)."""
    return x if math.isfinite(x) else None


def answer_of(text: str) -> str | None:
    """The published final-answer pattern: the text after "the answer is" up to a comma or period, or before
    "is the answer" (lowercase); None when neither is there."""
    low = text.lower()
    for pat in _ANSWER:
        m = pat.search(low)
        if m:
            return m.group(1).strip()
    return None


_STOPS: dict[int, tuple[object, frozenset]] = {}


def stop_tokens(tok) -> frozenset:
    """The token ids that end a step: a newline anywhere in the token's text, or text ending with "." (the published
    stop strings are newlines and ". "; a token cannot see the space after its period)."""
    hit = _STOPS.get(id(tok))
    if hit is None or hit[0] is not tok:
        ids = set()
        for i in range(len(tok)):
            t = tok.decode([i])
            if "\n" in t or t.rstrip(" ").endswith("."):
                ids.add(i)
        hit = (tok, frozenset(ids))
        _STOPS[id(tok)] = hit
    return hit[1]


def strip_word(w: str) -> str:
    """A word's letters and digits (the published query builder's cleaning)."""
    return re.sub(r"[^a-zA-Z0-9]", "", w)


@dataclass(slots=True)
class Step:
    """One evaluated step: the greedy step and the uncertainty of its prompt."""

    text: str  # the greedy step, stripped
    ids: list[int]
    logprob: list[float]
    score: float  # eigen score of its samples (+inf: fewer than two samples with text)


class Seakr(FewShotMethod):
    name = "seakr"
    cfg: SeakrConfig

    def __init__(self, cfg: SeakrConfig, tokenizer):
        super().__init__(cfg, tokenizer)
        self.words = word_boundaries(tokenizer)
        self.stops = stop_tokens(tokenizer)
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise ValueError("seakr feeds an EOS after each sample: the tokenizer names no EOS token")
        self.sampling = SamplingParams(temperature=cfg.sample_temperature, top_p=cfg.sample_top_p,
                                       top_k=cfg.sample_top_k, seed=cfg.seed)

    def __call__(self, ex):
        cfg = self.cfg
        res, case = self.open(ex)
        qkey = stable_id(ex)
        steps: list[str] = []
        docs: list = []
        searched: set[str] = set()
        n_eval = 0  # evaluations so far: each names its samples' keys
        while True:
            n_eval += 1
            st, = yield from self.evaluate(res, [rag_prompt(self.demos, docs, case, join(*steps))], qkey, n_eval)
            if answer_of(st.text):
                steps.append(st.text)
                res.rounds.append(Round(uncertainty=finite(st.score)))
                break
            if st.text and st.score <= cfg.eigen_threshold:
                steps.append(st.text)
                res.rounds.append(Round(uncertainty=finite(st.score)))
            else:  # the step is dropped: retrieval, then the step again with each new document
                query = yield from self.query(ex.question, st, steps[-1] if steps else "")
                rnd = Round(trigger_sentence=st.text, query=query, uncertainty=finite(st.score))
                res.rounds.append(rnd)
                if query in searched:  # (the published loop ends on a repeated query)
                    break
                searched.add(query)
                found = yield from search(res, truncate_query(self.tok, query, cfg.max_query_tokens),
                                          cfg.retrieve_topk)
                rnd.doc_ids = [str(d.id) for d in found]
                have = {str(d.id) for d in docs}
                new = [d for d in found if str(d.id) not in have]
                if not new:
                    break
                cands = yield from self.evaluate(
                    res, [rag_prompt(self.demos, docs + [d], case, join(*steps)) for d in new], qkey, n_eval + 1)
                n_eval += len(new)
                best = min(range(len(new)), key=lambda i: cands[i].score if cands[i].text else float("inf"))
                rnd.chosen_doc = str(new[best].id)
                docs.append(new[best])
                steps.append(cands[best].text)
                if answer_of(cands[best].text):
                    break
            if len(steps) >= cfg.max_reasoning_steps or len(docs) >= cfg.max_docs:
                break
        return (yield from finish_answer(res, self.tok, self.demos, case, join(*steps)))

    # ---- evaluations: the greedy step, its samples, their hidden states and eigen score
    def evaluate(self, res: QuestionResult, prompts: list[str], qkey: int, first: int):
        """`steps = yield from self.evaluate(res, prompts, qkey, first)`: one Step per prompt, all prompts' generations
        in flight together (prompt j is evaluation first + j: its samples' keys). The greedy step of a lone prompt
        continues branch 0 (the text of the steps before it is cached there); every other generation is one-shot."""
        cfg, tok = self.cfg, self.tok
        S = cfg.samples
        parts = []
        for j, p in enumerate(prompts):
            parts.append(Generate(p, cfg.step_max_tokens, 0 if len(prompts) == 1 else None, stop_ids=self.stops))
            parts += [Generate(p, cfg.step_max_tokens, None, stop_ids=self.stops, sampling=self.sampling,
                               sample_key=sampling_key(qkey, first + j, i)) for i in range(S)]
        gens = yield Parallel(parts)
        feeds, owner = [], []
        for j, p in enumerate(prompts):
            for g in gens[j * (S + 1) + 1: (j + 1) * (S + 1)]:
                account(res, g)
                if not self.sample_text(g):  # (no text: left out of the score, as published)
                    continue
                # the EOS goes in place of the last token (after it when an EOS ended the sample)
                ids = list(g.ids) if g.ended_by_eos else list(g.ids[:-1])
                feeds.append(Generate(p, 1, None, suffix_ids=tuple(ids + [self.eos]),
                                      hidden_layer=cfg.hidden_layer))
                owner.append(j)
        hid = (yield Parallel(feeds)) if feeds else []
        out = []
        for j in range(len(prompts)):
            g = gens[j * (S + 1)]
            account(res, g)
            z = [h.hidden for h, o in zip(hid, owner) if o == j]
            score = eigen_score(torch.stack(z), cfg.eigen_alpha) if len(z) >= 2 else float("inf")
            out.append(Step(tok.decode(g.ids, skip_special_tokens=True).strip(), list(g.ids), list(g.logprob),
                            score))
        for h in hid:
            account(res, h)
        return out

    def sample_text(self, g) -> str:
        """A sample's text without the stop token that ended it (the published output leaves its stop string
        out), stripped."""
        ids = g.ids[:-1] if g.ids and not g.ended_by_eos and g.ids[-1] in self.stops else g.ids
        return self.tok.decode(ids, skip_special_tokens=True).strip()

    def query(self, question: str, st: Step, previous: str):
        """`q = yield from self.query(...)`: the sure words of the dropped step (in the question, in the previous
        step, or least likely token with 1 - p <= prob_threshold), content words only, minus the published stop
        list; none: the question's content words."""
        cfg = self.cfg
        spans = self.words.spans(st.ids)
        words = self.words.texts(st.ids, spans)
        sure = []
        for (l, r), w in zip(spans, words):
            w = strip_word(w)
            if not w:
                continue
            doubt = max(1.0 - math.exp(lp) for lp in st.logprob[l:r])
            if w in question or (previous and w in previous) or doubt <= cfg.prob_threshold:
                sure.append(w)
        q = yield from self.content(" ".join(sure))
        if not q:
            q = yield from self.content(question)
        return q

    def content(self, text: str):
        """The words of text that are content words (spaCy POS) and not in the published stop list, in order."""
        real = yield from real_words(text)
        return " ".join(w for w in text.split() if matches_real_word(w, real) and w not in DROPPED_QUERY_WORDS)


def decisions(r: QuestionResult) -> dict:
    """What `fastrag parity --method seakr` compares: each round (kept step or retrieval: the dropped step, its
    query, documents and the document kept), the answer."""
    return {
        "trigger": [x.trigger_sentence for x in r.rounds],
        "query": [x.query for x in r.rounds if x.query is not None],
        "docs": [list(x.doc_ids) for x in r.rounds if x.query is not None],
        "chosen": [x.chosen_doc for x in r.rounds if x.query is not None],
        "answer": (r.metrics or {}).get("answer") if r.error is None else f"error: {r.error}",
    }


def _oracle(hf_model, tokenizer, retriever, cfg):
    from fastrag.oracle.seakr import SeakrOracle

    return SeakrOracle(hf_model, tokenizer, retriever, cfg)


register(MethodSpec(
    name="seakr", description="SeaKR-style: retrieve when the eigen score of sampled continuations' hidden states "
    "passes a threshold; keep the document the model is least uncertain with",
    make_config=lambda dataset, path: method_config("seakr", dataset, path),
    make_policy=Seakr, make_oracle=_oracle, decisions=decisions))
