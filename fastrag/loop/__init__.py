"""The question loop: many questions' policies (generators yielding requests) served in batches over one engine.

`QuestionLoop` (fastrag.loop.core) runs them; the request types (fastrag.loop.requests) are what a policy yields;
`LoopEngine` (fastrag.loop.protocol) is what the loop needs from an engine.
"""

from fastrag.loop.config import LoopConfig
from fastrag.loop.core import QuestionLoop
from fastrag.loop.protocol import LoopEngine, SyncEngineBase
from fastrag.loop.questions import Ticket
from fastrag.loop.requests import (TEXT_REQUESTS, AttnColmax, AttnRows, Generate, Parallel, Policy, RealWords, Request,
                                   Search, SearchFailure, Sentences)

__all__ = ["QuestionLoop", "LoopConfig", "Ticket", "LoopEngine", "SyncEngineBase", "Generate", "AttnColmax", "AttnRows", "Search",
           "Sentences", "RealWords", "Parallel", "SearchFailure", "Request", "Policy", "TEXT_REQUESTS"]
