"""Per-question records shared by the engine, the per-question oracle, evaluation and parity."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Round:
    """One generation round of a dynamic-RAG method."""

    trigger_sentence: str | None = None  # sentence whose RIND score crossed the threshold (None: no retrieval)
    hit_words: list[str] = field(default_factory=list)  # words of that sentence that hit (after the POS filter)
    # query sent to the retriever; under `fidelity: "published"` the query as formulated, which the published code
    # logs, before the retriever's round trip through the tokenizer (fastrag.methods.published.search_query)
    query: str | None = None
    doc_ids: list[str] = field(default_factory=list)  # retrieved passage ids, best first
    # `fidelity: "published"` only (None otherwise), what the published code logs of a retrieval: the trigger
    # sentence's words as it spells them (raw token strings) and the text kept before that sentence
    sentence_words: list[str] | None = None
    kept: str | None = None
    # seakr only: the retrieved document the method kept (the one its step was least uncertain with), and the
    # uncertainty of the step this round judged (its eigen score; None: fewer than two samples had text)
    chosen_doc: str | None = None
    uncertainty: float | None = None


@dataclass(slots=True)
class BeamNode:
    """One tuple <q, Q, E, a, s> of a BeamSearchQA beam (paper Algorithm 1); q is the record's question."""

    queries: list[str] = field(default_factory=list)  # Q: the queries retrieved for, in path order
    evidence: list[str] = field(default_factory=list)  # E: the summarised evidence of each query
    doc_ids: list[list[str]] = field(default_factory=list)  # the passages each query retrieved, best first
    answer: str = ""  # a = Answer(q, Q, E)
    score: float = 0.0  # s = Score(q, Q, E, a), in [0, 1]
    depth: int = 0  # 0: the initial beam


@dataclass(slots=True)
class QuestionResult:
    """Everything one question produced; one line of results.jsonl."""

    qid: str
    question: str
    gold: list[str]
    text: str = ""  # final generated reasoning text
    prediction: str = ""  # answer extracted from text (see fastrag.data.metrics.extract_answer)
    rounds: list[Round] = field(default_factory=list)
    prefill_tokens: int = 0  # tokens pushed through the model in prefills (after prefix reuse)
    decode_tokens: int = 0  # tokens produced by decode steps
    wall_s: float = 0.0  # time from first schedule to finish (engine) or per-question time (oracle)
    error: str | None = None  # a per-question problem (the run records it and goes on)
    metrics: dict = field(default_factory=dict)  # em / f1 / accuracy, filled by evaluation
    # per-question engine counters kept by the policies (fastrag/methods/common.py): generate_calls,
    # reused_prompt_tokens (shared prefix + own cache hits), searches, retrieval_wait_s, short_retrievals
    counters: dict = field(default_factory=dict)
    llm_calls: int = 0  # generate calls (0 in records of methods that do not count them)
    chosen: BeamNode | None = None  # BeamSearchQA: the tuple whose answer is the prediction
    beams: list[list[BeamNode]] = field(default_factory=list)  # BeamSearchQA: the kept beam after each depth

    @property
    def retrievals(self) -> int:
        return sum(1 for r in self.rounds if r.query is not None)

    def to_json(self) -> dict:
        d = asdict(self)
        d["retrievals"] = self.retrievals
        return d

    @classmethod
    def from_json(cls, d: dict) -> "QuestionResult":
        d = dict(d)
        d.pop("retrievals", None)
        d["rounds"] = [Round(**r) for r in d.get("rounds", [])]
        if d.get("chosen") is not None:
            d["chosen"] = BeamNode(**d["chosen"])
        d["beams"] = [[BeamNode(**n) for n in beam] for beam in d.get("beams", [])]
        return cls(**d)


def holds_records(out: Path) -> bool:
    """Whether a run folder (or one of its subfolders: ray shards, parity's engine/ and oracle/) has a results file
    with anything in it. (Here, not in fastrag.eval, so that the command line can say what an interrupted start-up
    kept without importing torch.)"""
    return any(p.is_file() and p.stat().st_size > 0 for p in Path(out).rglob("results.jsonl"))
