"""What a policy asks the question loop for: the contract between a method and fastrag.loop.

A method writes one question's logic as a plain generator that yields these requests and receives their results
(fastrag.loop.core.QuestionLoop serves them in batches with the other questions' requests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Generator

from fastrag.trace import QuestionResult


@dataclass(slots=True)
class Generate:
    prompt: str
    max_new_tokens: int
    # which of the question's KV sequences to reuse: prompts of one family share a branch (an int >= 0);
    # None: a fresh sequence for this generation alone, released as soon as it finishes (a prompt nothing later
    # extends, e.g. one carrying retrieved documents, need not hold KV blocks)
    branch: int | None = 0
    # token ids appended to the tokenised prompt as they are (a generation resumed exactly where it stopped,
    # with no decode/encode round trip)
    suffix_ids: tuple[int, ...] = ()
    # track the in-context attention each token receives from the suffix on (Generation.attn covers suffix_ids
    # and the new tokens): DRAGIN streaming's a_i from the decode pass itself
    track_attn: bool = False
    # this generation's own sampling (fastrag.engine.SamplingParams; None: the engine's), and with it its sampling
    # key (None: derived from the question and its call number)
    sampling: object = None
    sample_key: int | None = None
    # token ids that end the generation when sampled (kept in its ids): a step's end without decoding past it
    stop_ids: frozenset | None = None
    # keep the residual stream after this layer at the prompt's last token (Generation.hidden)
    hidden_layer: int | None = None


@dataclass(slots=True)
class AttnColmax:
    """Last-layer attention each token receives from later tokens (RIND pass). Result: list[float]."""

    ids: list[int]


@dataclass(slots=True)
class AttnRows:
    """Head-mean last-layer attention matrix over ids (QFS pass). Result: tensor [T, T] float64."""

    ids: list[int]


@dataclass(slots=True)
class Search:
    query: str
    k: int


@dataclass(slots=True)
class Sentences:
    """spaCy's sentences of text (fastrag.text.sentences.split_sentences). Result: list[Sentence]."""

    text: str
    kind: ClassVar[str] = "sentences"


@dataclass(slots=True)
class RealWords:
    """Texts of text's spaCy tokens with a content POS (fastrag.text.realwords.real_words). Result: set[str]."""

    text: str
    kind: ClassVar[str] = "real_words"


TEXT_REQUESTS = (Sentences, RealWords)


@dataclass(slots=True)
class Parallel:
    """Several requests of one question in flight at once. Result: the list of their results, in order.

    parts: Generate / Search / AttnColmax / AttnRows / Sentences / RealWords (no nested Parallel). Generates with an
    int branch must name distinct branches (one sequence cannot run two generations); branch None parts each get a
    one-shot sequence.
    Every part joins the batches of its kind with the other questions' requests: all Searches of one Parallel go to
    the retriever in one call. An empty Parallel resumes at once with [].
    """

    parts: list


Request = Generate | AttnColmax | AttnRows | Search | Sentences | RealWords | Parallel
Policy = Callable[[object], Generator[Request, object, QuestionResult]]


@dataclass(slots=True)
class SearchFailure:
    """In place of a query's documents: its retrieval raised (the message says how)."""

    message: str


def check_parallel(req: Parallel) -> None:
    """Refuse a Parallel the loop cannot serve (a nested Parallel, a bad branch, two generations on one branch)."""
    branches = []
    for i, part in enumerate(req.parts):
        if isinstance(part, Parallel):
            raise ValueError(f"Parallel part {i} is itself a Parallel; flatten it")
        if isinstance(part, Generate) and part.branch is not None:
            if isinstance(part.branch, bool) or not isinstance(part.branch, int) or part.branch < 0:
                raise ValueError(f"Parallel part {i}: branch must be an int >= 0 or None, got {part.branch!r}")
            branches.append(part.branch)
    if len(set(branches)) != len(branches):
        dup = sorted({b for b in branches if branches.count(b) > 1})
        raise ValueError(f"Parallel generations share branch(es) {dup}: each needs its own KV sequence "
                         "(distinct branches, or branch=None for a one-shot sequence)")
