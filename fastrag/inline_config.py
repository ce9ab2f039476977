"""Configs given as objects: a dict read where a config file's path is read (fastrag.config's loaders, the methods'
make_config), so that the public API and the server load a config without writing it to a file."""

from __future__ import annotations

from pathlib import Path


class InlineConfig(dict):
    """A config given as an object instead of a file (fastrag.RAG.run(config={...}), a served request's
    retrieval.config): every loader that takes a config file's path takes one of these too, and reads its keys as
    it reads a file's. Messages name it `name` where they would name the file, so it stands where a path stands
    (str() and os.fspath() give the name)."""

    def __init__(self, values: dict, name: str = "config"):
        from fastrag.config import ConfigError

        if not isinstance(values, dict):
            raise ConfigError(f"{name}: expected a dict of config fields, got {type(values).__name__}")
        bad = [k for k in values if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{name}: config field names must be strings, got {bad[0]!r}")
        super().__init__(values)
        self.name = name

    def __str__(self) -> str:
        return self.name

    __format__ = lambda self, spec: format(self.name, spec)  # noqa: E731  (f"{cfg}: ..." names it)

    def __fspath__(self) -> str:
        return self.name


def config_source(config, name: str = "config"):
    """What the loaders take for `config`: None, a path (str or os.PathLike) as given, a dict as an InlineConfig
    named `name`; anything else is a ConfigError."""
    from fastrag.config import ConfigError

    if config is None or isinstance(config, InlineConfig):
        return config
    if isinstance(config, dict):
        return InlineConfig(config, name)
    if isinstance(config, (str, Path)) or hasattr(config, "__fspath__"):
        return config
    raise ConfigError(f"{name}: expected a dict of config fields or a JSON file's path, got {type(config).__name__}")
