"""Per-question records shared by the engine, the per-question oracle, evaluation and parity."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class Round:
    """One generation round of a dynamic-RAG method."""

    trigger_sentence: str | None = None  # sentence whose RIND score crossed the threshold (None: no retrieval)
    hit_words: list[str] = field(default_factory=list)  # words of that sentence that hit (after the POS filter)
    query: str | None = None  # query sent to the retriever
    doc_ids: list[str] = field(default_factory=list)  # retrieved passage ids, best first


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
        return cls(**d)
