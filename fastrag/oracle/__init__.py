"""Per-question reference implementations (parity oracles and speed baselines).

Exports are resolved lazily so that `fastrag.oracle.decisions` (the pure rules) imports without spaCy, the
datasets or the retrievers.
"""

__all__ = ["BaselineOracle", "DraginOracle", "FlareOracle", "run_oracle"]


def __getattr__(name: str):
    if name == "FlareOracle":
        from fastrag.oracle.flare import FlareOracle

        return FlareOracle
    if name == "BaselineOracle":
        from fastrag.oracle.baselines import BaselineOracle

        return BaselineOracle
    if name in __all__:
        from fastrag.oracle import dragin

        return getattr(dragin, name)
    raise AttributeError(f"module 'fastrag.oracle' has no attribute {name!r}")
