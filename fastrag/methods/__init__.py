"""Dynamic-RAG methods as scheduler policies. Importing this package registers every method (registry.py)."""

from fastrag.methods import dragin as _dragin  # noqa: F401
from fastrag.methods import baselines as _baselines  # noqa: F401,E402
from fastrag.methods import dragin_streaming as _dragin_streaming  # noqa: F401,E402
from fastrag.methods import flare as _flare  # noqa: F401,E402
from fastrag.methods import token_rag as _token_rag  # noqa: F401,E402
from fastrag.methods import beamsearchqa as _beamsearchqa  # noqa: F401
from fastrag.methods import ircot as _ircot  # noqa: F401,E402
from fastrag.methods import iter_retgen as _iter_retgen  # noqa: F401,E402
from fastrag.methods import etc as _etc  # noqa: F401,E402
from fastrag.methods import self_ask as _self_ask  # noqa: F401,E402
from fastrag.methods import seakr as _seakr  # noqa: F401,E402
