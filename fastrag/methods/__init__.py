"""Dynamic-RAG methods as scheduler policies. Importing this package registers every method (registry.py)."""

from fastrag.methods import dragin as _dragin  # noqa: F401
