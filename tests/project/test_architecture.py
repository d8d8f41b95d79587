"""The house rules of docs/architecture.md, checked: layers (import-linter), no import cycle,
module and function sizes, no dead code, and references (paths, design anchors) that resolve
inside the repository."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx
import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "autoprec"
DOC = ROOT / "docs" / "architecture.md"
#: A module clearly too big; ~400 lines is only the point to look for a second concern
#: (docs/architecture.md#house-style).
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


_SKIP_DIRS = {".git", ".venv", "out", "__pycache__", ".pytest_cache"}


def _tracked_text_files() -> list[Path]:
    """The project's text files: git's list in a checkout, else every file outside build folders."""
    keep = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".json"}
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        names = [ROOT / f for f in r.stdout.split()]
    else:  # an unpacked source tree without git
        names = [p for p in ROOT.rglob("*") if not _SKIP_DIRS & set(p.relative_to(ROOT).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return [p for p in names if p.suffix in keep and p.is_file()]


def test_layer_contracts_hold():
    """`lint-imports` keeps the layers contracts of pyproject.toml (the package's layers, and the
    command drivers' inside autoprec.commands): an upward import breaks one."""
    exe = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "2 kept, 0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_no_import_cycle_between_modules():
    """No cycle among the package's modules, function-level imports included (grimp reads every
    import statement); a package's __init__ counts as its own module."""
    graph = grimp.build_graph("autoprec", cache_dir=None)
    g = nx.DiGraph()
    for m in graph.modules:
        for dep in graph.find_modules_directly_imported_by(m):
            if dep != m and not m.startswith(dep + "."):  # a module importing its own package's __init__
                g.add_edge(m, dep)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles[:5]}"


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_module_and_function_sizes():
    """No module in autoprec/ over 600 lines, no function over 80 (docs/architecture.md#house-style)."""
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{rel}: {len(text.splitlines())} lines")
        for fn in _functions(ast.parse(text)):
            n = fn.end_lineno - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                long_functions.append(f"{rel}:{fn.lineno} {fn.name}: {n} lines")
    assert not long_modules and not long_functions, long_modules + long_functions


def test_tune_reads_as_its_phases():
    """``tune()``'s body (after its docstring) fits on one screen: it only calls the phases."""
    tree = ast.parse((PACKAGE / "search" / "study.py").read_text(encoding="utf-8"))
    tune = next(f for f in _functions(tree) if f.name == "tune")
    body = tune.body[1:] if isinstance(tune.body[0], ast.Expr) else tune.body
    assert body[-1].end_lineno - body[0].lineno + 1 <= 20


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens (lines inside
    fenced code blocks are not headings)."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


#: A repository path named in a text file: tests/..., docs/..., autoprec/..., examples/...,
#: benchmarks/... or .ci/...; ``*`` and ``<placeholder>`` stand for any text (a glob).
_PATH_REF = re.compile(r"(?<![\w./-])((?:tests|docs|autoprec|examples|benchmarks|\.ci)/[\w./*<>-]*[\w*>])")


def test_paths_named_in_the_repository_exist():
    """Every repository path a file names (a docstring's ``tests/applied/test_regions.py``, a
    page's ``docs/usage.md``, a results folder) exists, or matches a file where it is a pattern
    (``tests/cases/test_cNN_*``): moving or renaming a file breaks no reference to it."""
    bad = []
    for p in _tracked_text_files():
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for ref in _PATH_REF.findall(line):
                pattern = re.sub(r"<[^>]*>|NN", "*", ref)
                if not (any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / ref).exists()):
                    bad.append(f"{p.relative_to(ROOT)}:{i}: {ref}")
    assert not bad, bad[:20]


#: A module path as the pages write it, relative to autoprec/ and between backticks: ``capture/dims``,
#: ``applied/apply.py``, ``measure/drift._first_pass`` (a name in the module); Python identifiers only,
#: so globs, placeholders and file names with dots (``out/x.policy.json``) are left to ``_PATH_REF``.
_MODULE_REF = re.compile(r"(?<!`)`{1,2}([a-z_]\w*(?:/[a-z_]\w*)+(?:\.[A-Za-z_]\w*)?)`{1,2}(?!`)")

#: A rate between backticks (``tokens/s``) reads as a module path but names none.
_RATE = re.compile(r"/(?:s|ms|us|ns|min|h)$")


def _module_path_resolves(ref: str, folder: Path) -> bool:
    """Whether ``ref`` (a :data:`_MODULE_REF` match) is a file or folder under ``folder`` (the page's
    own), the repository root or autoprec/: as written, with ``.py``, or without its last ``.name``
    (``measure/drift._first_pass`` names ``autoprec/measure/drift.py``)."""
    stem = ref[:-3] if ref.endswith(".py") else ref.rsplit(".", 1)[0]
    return any((base / name).exists() for base in (folder, ROOT, PACKAGE)
               for name in (ref, stem, stem + ".py"))


def _unresolved_module_paths(text: str, folder: Path) -> list[str]:
    """``"line: ref"`` for each module path of ``text`` (a Markdown page in ``folder``) that
    :func:`_module_path_resolves` does not find, e.g. ``runtime/outputs`` after ``runtime/`` became
    ``applied/``."""
    return [f"{i}: {ref}" for i, line in enumerate(text.splitlines(), 1)
            for ref in _MODULE_REF.findall(line)
            if not _RATE.search(ref) and not _module_path_resolves(ref, folder)]


def test_module_paths_named_in_pages_exist():
    """Every module path a Markdown page names the short way, relative to autoprec/ (a table's
    ``capture/dims``, a design note's ``applied/saved.py``), exists: ``_PATH_REF`` sees only paths
    that start at the repository root (``autoprec/...``), so a moved module's short name went stale
    unnoticed (docs/architecture.md named ``runtime/outputs`` after ``runtime/`` became ``applied/``)."""
    bad = [f"{p.relative_to(ROOT)}:{where}" for p in _tracked_text_files() if p.suffix == ".md"
           for where in _unresolved_module_paths(p.read_text(encoding="utf-8", errors="replace"), p.parent)]
    assert not bad, bad[:20]


def test_module_path_check_catches_a_moved_module():
    """The check of module paths in pages: a package that no longer exists (``runtime/``) fails,
    with or without ``.py``; the module's new place, a name in a module, a page-relative file
    and a rate pass."""
    page = ROOT / "docs"
    old = "| `pytree` | ... | `capture/dims`, `runtime/outputs`, ``runtime/saved.py`` |"
    assert _unresolved_module_paths(old, page) == ["1: runtime/outputs", "1: runtime/saved.py"]
    new = ("| `pytree` | ... | `capture/dims`, `applied/outputs`, ``applied/saved.py`` |\n"
           "`measure/drift._first_pass`, `applied/nowhere.py`, 18 `tokens/s`, `autoprec/applied/apply.py`")
    assert _unresolved_module_paths(new, page) == ["2: applied/nowhere.py"]
    assert _unresolved_module_paths("`results/tiny`", ROOT / "benchmarks") == []


def test_design_references_resolve():
    """Every ``architecture.md#anchor`` reference names a heading of docs/architecture.md, and
    every ``#anchor`` in a reference list such as ``(docs/architecture.md#search, #measurements)``."""
    anchors = _anchors(DOC.read_text(encoding="utf-8"))
    assert {"layers", "measurements", "policy-file", "design-choices"} <= anchors
    bad = []
    for p in _tracked_text_files():
        if p.name == "test_architecture.py":
            continue
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for ref in re.finditer(r"architecture\.md((?:#[\w-]+)(?:,\s*#[\w-]+)*)", line):
                for a in re.findall(r"#([\w-]+)", ref.group(1)):
                    if a not in anchors:
                        bad.append(f"{p.relative_to(ROOT)}:{i}: #{a}")
    assert not bad, bad[:20]


@pytest.mark.parametrize("name", ["autoprec.search.study", "autoprec.commands.train", "autoprec.cli"])
def test_modules_import_cleanly_in_a_fresh_interpreter(name):
    """Each entry module imports on its own (no order-dependent cycle hidden by earlier imports)."""
    r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def _python_files() -> list[Path]:
    """The Python files that may use the package's names: autoprec/, tests/, examples/, benchmarks/."""
    return [p for d in ("autoprec", "tests", "examples", "benchmarks")
            for p in sorted((ROOT / d).rglob("*.py"))]


def test_every_function_and_class_is_used():
    """No dead code: each function, method and class defined in autoprec/ is named somewhere besides
    its own definition (a call, a test, an example, a page of docs/, a registry entry); dunder
    methods aside. Something nothing names is removed rather than kept."""
    texts = [p.read_text(encoding="utf-8") for p in _python_files()]
    texts += [p.read_text(encoding="utf-8") for p in (*(ROOT / "docs").glob("*.md"), ROOT / "README.md")]
    words: dict[str, int] = {}
    for text in texts:
        for w in re.findall(r"\w+", text):
            words[w] = words.get(w, 0) + 1
    unused = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name}" for p in sorted(PACKAGE.rglob("*.py"))
              for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
              and not n.name.startswith("__") and words.get(n.name, 0) <= 1]
    assert not unused, unused


def test_every_attribute_set_is_read():
    """Each attribute autoprec/ sets on ``self`` is read somewhere (by autoprec, a test, an example
    or a benchmark; by name or by ``getattr``'s string): an attribute set and never read is dead."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in _python_files()}
    read = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and not isinstance(n.ctx, ast.Store):
                read.add(n.attr)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                read.add(n.value)
    unread = [f"{p.relative_to(ROOT)}:{n.lineno} self.{n.attr}" for p, tree in trees.items()
              if p.is_relative_to(PACKAGE) for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"
              and not n.attr.startswith("__") and n.attr not in read]
    assert not unread, unread
