"""The package's layout rules (issue 92), checked on its source files: fastrag/ and kernels/ (installed as
fastrag.kernels).

- no source file over MAX_LINES lines: a module that long holds more than one idea, and splitting it later costs more
  than keeping it small;
- no module imports a private name (`_x`) of another fastrag module, in any form: `from fastrag.a import _x`,
  `from .a import _x`, `import fastrag.a` then `fastrag.a._x`, or `m._x` where m is an imported fastrag module. A name
  another module needs is public (or the code that needs it moves). A private *module* (the compiled `fastrag._C`)
  is a module, not a name, and may be imported;
- no comment or docstring cites DESIGN.md, which is not in the repository (docs/architecture.md is).

Only the files are read (with `ast` and `tokenize`); nothing is imported.
"""
from __future__ import annotations

import ast
import io
import os
import tokenize
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def _sources() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package (symbolic links not followed: a checkout's link to
    kernels/ is not a second copy of it)."""
    out: dict[str, Path] = {}
    for top, package in ((ROOT / "fastrag", ("fastrag",)), (ROOT / "kernels", ("fastrag", "kernels"))):
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not (Path(dirpath) / d).is_symlink())
            rel = Path(dirpath).relative_to(top).parts
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                parts = package + rel + (() if f == "__init__.py" else (f[:-3],))
                out[".".join(parts)] = Path(dirpath) / f
    return out


SOURCES = _sources()
PACKAGES = {name for name, path in SOURCES.items() if path.name == "__init__.py"}


EXTENSIONS = {"fastrag._C"}  # the compiled extension (setup.py), built or not


def _is_module(name: str) -> bool:
    """Whether a dotted name is a module of the package (a source file, a package, or the compiled extension)."""
    return name in SOURCES or name in EXTENSIONS


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names, in module `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if module not in PACKAGES:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def private_imports(module: str, path: Path) -> list[str]:
    """`file:line name` of every private name of another fastrag module that `module` imports or reads."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    bound: dict[str, str] = {}  # a local name -> the fastrag module it is bound to
    out = []

    def flag(node: ast.AST, owner: str, name: str) -> None:
        full = f"{owner}.{name}"
        if owner != module and _private(name) and not _is_module(full):
            out.append(f"{rel}:{node.lineno} {full}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "fastrag" or a.name.startswith("fastrag."):
                    if a.asname:
                        bound[a.asname] = a.name
                    else:
                        bound["fastrag"] = "fastrag"
        elif isinstance(node, ast.ImportFrom):
            owner = _resolve(module, node)
            if owner != "fastrag" and not owner.startswith("fastrag."):
                continue
            for a in node.names:
                flag(node, owner, a.name)
                if _is_module(f"{owner}.{a.name}"):
                    bound[a.asname or a.name] = f"{owner}.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        parts = _dotted(node)
        if not parts or parts[0] not in bound:
            continue
        name = bound[parts[0]]
        for p in parts[1:]:
            if _private(p):
                flag(node, name, p)
                break
            if not _is_module(f"{name}.{p}"):
                break
            name = f"{name}.{p}"
    return sorted(set(out))


def _comments_and_docstrings(path: Path):
    """(line, text) of every comment and every string constant that stands as a statement (docstrings)."""
    src = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src, str(path))):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def test_the_sources_are_found():
    assert "fastrag.cuda_graphs" in SOURCES or "fastrag.cuda_graphs.decode" in SOURCES
    assert "fastrag.kernels.paged_prefill" in SOURCES


def test_no_source_file_is_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_module_imports_another_modules_private_name():
    found = [hit for module, path in SOURCES.items() for hit in private_imports(module, path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_no_comment_or_docstring_cites_design_md():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in SOURCES.values()
             for line, text in _comments_and_docstrings(p) if "DESIGN.md" in text]
    assert not found, "DESIGN.md is not in the repository (cite docs/architecture.md): " + ", ".join(found)


def test_the_private_import_check_sees_every_form(tmp_path):
    """The checker itself, on a module written here: each form the rule names is caught, and the allowed ones are
    not."""
    src = tmp_path / "probe.py"
    src.write_text(
        "import fastrag.text.pool\n"
        "import fastrag.text.pool as tp\n"
        "from fastrag.text import pool\n"
        "from fastrag.text.pool import _READY, TextPool\n"
        "from . import _private_sibling\n"
        "from fastrag import _C\n"
        "x = fastrag.text.pool._BATCH\n"
        "y = tp._BATCH\n"
        "z = pool._READY\n"
        "ok = pool.TextPool, tp.__name__\n",
        encoding="utf-8")
    hits = private_imports("fastrag.text.probe", src)
    lines = sorted(int(h.split(" ")[0].rsplit(":", 1)[1]) for h in hits)
    assert lines == [4, 5, 7, 8, 9], hits
    assert {h.split(" ")[1] for h in hits} == {"fastrag.text._private_sibling", "fastrag.text.pool._BATCH",
                                               "fastrag.text.pool._READY"}


def test_every_package_is_listed_for_installation():
    # pyproject lists its packages by hand (fastrag.kernels comes from kernels/): a package missing there is
    # missing from a wheel or a non-editable install, though an editable one still finds it
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fastrag").rglob("__init__.py")
             if not p.is_symlink() and "__pycache__" not in p.parts}
    assert found - listed == set(), f"packages not listed in pyproject.toml: {sorted(found - listed)}"


def test_docs_environment_lists_every_variable_the_package_reads():
    # docs/environment.md is the one list of the FASTRAG_* switches; a variable read in fastrag/ or kernels/ but
    # missing there (or listed but read nowhere) is a switch a user cannot find (or a dead row)
    import re

    read = set()
    # (setup.py's build switches and the test/benchmark harnesses' data paths are listed too)
    files = [*SOURCES.values(), ROOT / "setup.py", *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "scripts").glob("*")]
    for p in files:
        if p.is_file():
            # "NAME", $NAME, and NAME= as a harness sets it (FASTRAG_NOTE, which bench_args writes out)
            pairs = re.findall(r"""["'$](FASTRAG_[A-Z0-9_]+)|\b(FASTRAG_[A-Z0-9_]+)=""", p.read_text(encoding="utf-8"))
            read |= {a or b for a, b in pairs}
    read.discard("FASTRAG_")
    read.discard("FASTRAG_WITH_CUDA")  # a C++ macro setup.py defines for csrc/, not an environment variable
    listed = set(re.findall(r"^\| `(FASTRAG_[A-Z0-9_]+)`", (ROOT / "docs" / "environment.md").read_text(
        encoding="utf-8"), flags=re.M))
    assert read, "no FASTRAG_ variable found in the sources: the pattern is wrong"
    assert read - listed == set(), f"read but not in docs/environment.md: {sorted(read - listed)}"
    assert listed - read == set(), f"in docs/environment.md but read nowhere: {sorted(listed - read)}"


def _package_variables() -> set[str]:
    import re

    names = set()
    for p in (ROOT / "fastrag").rglob("*.py"):
        names |= {a or b for a, b in re.findall(r"""["'$](FASTRAG_[A-Z0-9_]+)|\b(FASTRAG_[A-Z0-9_]+)=""",
                                                p.read_text(encoding="utf-8"))}
    names.discard("FASTRAG_")
    return names


def test_every_variable_the_package_names_has_a_rule_in_settings():
    # fastrag.settings.VARIABLES is where each FASTRAG_* variable is parsed; one named in fastrag/ without a rule
    # there would be read some other way (or not at all)
    from fastrag.settings import VARIABLES

    named = _package_variables()
    assert "FASTRAG_SDPA" in named, "the pattern finds no variable"
    assert named - set(VARIABLES) == set(), f"named in fastrag/ but not in fastrag.settings.VARIABLES: " \
                                            f"{sorted(named - set(VARIABLES))}"
    assert set(VARIABLES) - named == {"FASTRAG_STEP_TRACE", "FASTRAG_KERNEL_PROFILE", "FASTRAG_LAUNCH_PROFILE",
                                      "FASTRAG_SYNC_WATCH", "FASTRAG_ES_URL", "FASTRAG_ES_INDEX",
                                      "FASTRAG_CACHE"} - named


def test_only_settings_reads_the_environment_for_a_fastrag_variable():
    # every read of os.environ / os.getenv in fastrag/ outside settings.py must not be of a FASTRAG_* variable,
    # by its name or by a *_ENV / ENV_VAR constant holding one
    import re

    reads = re.compile(r"os\.environ\.get\(|os\.environ\[|os\.getenv\(|environ\.get\(")
    bad = []
    for p in sorted((ROOT / "fastrag").rglob("*.py")):
        if p.name == "settings.py" and p.parent.name == "fastrag":
            continue
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if reads.search(line) and re.search(r"FASTRAG_|_ENV\b|ENV_VAR\b", line):
                bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "FASTRAG_* read outside fastrag/settings.py:\n" + "\n".join(bad)


def test_the_environment_read_check_catches_a_direct_read(tmp_path):
    import re

    line = 'mode = os.environ.get(DECODE_ATTENTION_ENV, "native")'
    assert re.search(r"os\.environ\.get\(", line) and re.search(r"FASTRAG_|_ENV\b|ENV_VAR\b", line)
