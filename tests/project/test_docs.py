"""The documentation as a user meets it: the site builds in strict mode (broken links, anchors and API
references fail), every Python example in README.md and docs/*.md runs, and every ``autoprec``
command they show parses with the real argument parser (the cheap ones, on examples/tiny_mlp.py,
run for real).

Python blocks run page by page, in order, each page in a fresh namespace, in a scratch directory
where ``examples`` is the repository's (as from the repository root, which the pages say). The
blocks that are deliberately not run are listed in ``NOT_RUN`` with the reason, and counted.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"sh", "bash", "shell", "console"}

#: (page, section heading) of each Python block that is not run, and why. Keep it short.
NOT_RUN = {
    ("docs/architecture.md", "Public API"):
        "a listing of every signature with its defaults: apply(compile=True) and tune() with 20 compiled "
        "trials take minutes on a CPU; tests/project/test_public_api.py checks every call against the "
        "signatures, and the same calls run, cheaply, in docs/usage.md",
}

#: Pages whose examples need the optional integrations (transformers, lightning) run in a process of
#: their own; the others share one (each page in a fresh namespace), started in the environment
#: torchrun would set for one rank, for docs/distributed.md's process group.
GROUPS = {"integrations": ["docs/integrations.md"]}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown page."""

    page: str      # path relative to the repository, e.g. "docs/usage.md"
    line: int      # line of the opening fence (1-based)
    lang: str
    heading: str   # the section heading above it ("" before the first)
    code: str


def _blocks(path: Path) -> list[Block]:
    """The fenced code blocks of ``path`` with their language and section heading."""
    out, heading, fence, start, lang, body = [], "", None, 0, "", []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            m = re.match(r"(`{3,})\s*([\w+-]*)", stripped)
            if m:
                fence, start, lang, body = m.group(1), i, m.group(2).lower(), []
            elif re.match(r"#{1,6}\s", line):
                heading = line.lstrip("#").strip()
        elif stripped == fence:
            out.append(Block(str(path.relative_to(ROOT)), start, lang, heading, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{path.relative_to(ROOT)}:{start}: unclosed code fence"
    return out


ALL_BLOCKS = [b for p in PAGES for b in _blocks(p)]
PYTHON = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]


def _runs(b: Block) -> bool:
    return (b.page, b.heading) not in NOT_RUN


def test_site_builds_in_strict_mode(tmp_path):
    """``mkdocs build --strict`` (as ``make docs``): a broken link or anchor, a page left out of the
    nav or an API reference that does not resolve is an error; every public name gets its entry."""
    exe = Path(sys.executable).with_name("mkdocs")
    site = tmp_path / "site"
    r = subprocess.run([str(exe), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "WARNING" not in r.stderr, r.stderr[-5000:]
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    import autoprec

    missing = [n for n in autoprec.__all__ if not n.startswith("_")
               and f'id="autoprec.{n}"' not in api and f'id="autoprec.{n}.{n}"' not in api]
    assert not missing, f"no API reference entry for {missing}"


def test_api_page_names_every_export():
    """docs/api.md has one ``::: autoprec.NAME`` entry per name of ``autoprec.__all__``, and no
    entry for a name ``autoprec`` does not export (integrations aside)."""
    import autoprec

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    entries = set(re.findall(r"^::: autoprec\.(\w+)", text, re.M))
    public = {n for n in autoprec.__all__ if not n.startswith("_")}
    assert public <= entries, f"docs/api.md lacks {sorted(public - entries)}"
    assert entries - public <= {"integrations"}, sorted(entries - public)


def test_readme_is_a_front_door():
    """README.md: at most 150 lines, the two commands, and links into docs/ that exist."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert "make tune" in text and "make test" in text
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and all((ROOT / link).is_file() for link in links), links


def test_examples_import_only_the_public_api():
    """Examples import ``autoprec`` itself and its integrations, never an internal module."""
    bad = []
    for b in PYTHON:
        for m in re.finditer(r"^\s*(?:from|import)\s+(autoprec\.[\w.]+)", b.code, re.M):
            if not m.group(1).startswith("autoprec.integrations."):
                bad.append(f"{b.page}:{b.line}: {m.group(1)}")
    internal = re.compile(r"from autoprec\.(?!integrations\.)[\w.]+ import")
    prose = [f"{p.relative_to(ROOT)}: {m}" for p in PAGES
             for m in internal.findall(p.read_text(encoding="utf-8"))]
    assert not bad and not prose, bad + prose


def _resolves(dotted: str) -> bool:
    """``autoprec.a.b.C.d`` names an importable module and, below it, attributes that exist."""
    import importlib

    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_names_resolve():
    """Every ``autoprec.X.Y`` the pages, the package's docstrings and comments name (a module, a
    function, an attribute) exists: a renamed or moved name leaves no reference to its old home."""
    sources = [*PAGES, *sorted((ROOT / "autoprec").rglob("*.py"))]
    named: dict[str, str] = {}
    for p in sources:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"(?<![\w.])autoprec(?:\.\w+)+", line):
                named.setdefault(m.group(0), f"{p.relative_to(ROOT)}:{i}")
    assert len(named) > 100
    bad = [f"{where}: {name}" for name, where in sorted(named.items()) if not _resolves(name)]
    assert not bad, bad[:20]


def test_not_run_list_is_current():
    """Each entry of NOT_RUN names exactly one Python block (no stale exception), and few are kept."""
    for (page, heading), reason in NOT_RUN.items():
        found = [b for b in PYTHON if (b.page, b.heading) == (page, heading)]
        assert len(found) == 1, f"NOT_RUN entry {page} '{heading}' matches {len(found)} blocks ({reason})"
    assert len(NOT_RUN) <= 3
    print(f"{len(PYTHON)} Python blocks; {len(PYTHON) - len(NOT_RUN)} run, {len(NOT_RUN)} not run: "
          + "; ".join(f"{p} '{h}': {r}" for (p, h), r in NOT_RUN.items()))


_RUNNER = r'''
import json, sys, traceback
pages = json.load(open(sys.argv[1]))
for page, blocks in pages.items():
    ns = {"__name__": "__main__"}
    for line, code in blocks:
        try:
            # padded so that a traceback names the Markdown file's own line numbers
            exec(compile("\n" * line + code, page, "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: {page}: the block at line {line}", file=sys.stderr)
            sys.exit(1)
    print(f"ok: {page}: {len(blocks)} blocks", flush=True)
'''


def _scratch(tmp_path: Path) -> Path:
    """A working directory where ``examples`` (and ``tests/models``) are the repository's."""
    work = tmp_path / "work"
    (work / "tests").mkdir(parents=True)
    (work / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    (work / "tests" / "models").symlink_to(ROOT / "tests" / "models", target_is_directory=True)
    return work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_pages(group: str) -> list[str]:
    if group != "core":
        return GROUPS[group]
    taken = {p for pages in GROUPS.values() for p in pages}
    return [str(p.relative_to(ROOT)) for p in PAGES if str(p.relative_to(ROOT)) not in taken]


@pytest.mark.heavy
@pytest.mark.parametrize("group", ["core", "integrations"])
def test_python_examples_run(group, tmp_path):
    """Every Python block not in NOT_RUN runs without error, page by page in order."""
    if group == "integrations":
        pytest.importorskip("transformers")
        pytest.importorskip("lightning")
        pytest.importorskip("accelerate")
    pages = {p: [(b.line, b.code) for b in PYTHON if b.page == p and _runs(b)] for p in _group_pages(group)}
    pages = {p: blocks for p, blocks in pages.items() if blocks}
    assert pages, f"no Python example in group {group}"
    work = _scratch(tmp_path)
    (work / "blocks.json").write_text(json.dumps(pages))
    (work / "run_blocks.py").write_text(_RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if group == "core":  # one rank, in the environment torchrun would set (docs/distributed.md)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    r = subprocess.run([sys.executable, "run_blocks.py", "blocks.json"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    assert r.stdout.count("ok: ") == len(pages), r.stdout


def _shell_commands() -> list[tuple[Block, list[str]]]:
    """``(block, argv)`` of every shell line that runs ``autoprec`` or ``make`` (continuations
    joined, comments and a ``$`` prompt dropped)."""
    out = []
    for b in ALL_BLOCKS:
        if b.lang not in SHELL_LANGS:
            continue
        for line in b.code.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            argv = shlex.split(line, comments=True)
            if argv and (argv[0].endswith("/autoprec") or argv[0] in ("autoprec", "make")):
                out.append((b, argv))
    return out


COMMANDS = _shell_commands()


def test_shell_commands_parse(capsys):
    """Every ``autoprec ...`` line of the docs parses with autoprec's own argument parser (a
    misspelt or removed flag fails here), and every ``make TARGET`` names a Makefile target."""
    from autoprec.cli_parser import build_parser

    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    bad, n = [], 0
    for b, argv in COMMANDS:
        if argv[0] == "make":
            missing = [a for a in argv[1:] if "=" not in a and a not in targets]
            bad += [f"{b.page}:{b.line}: make {a}: no such target" for a in missing]
            continue
        n += 1
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as e:
            err = capsys.readouterr().err[-300:]
            bad.append(f"{b.page}:{b.line}: {shlex.join(argv)} -> exit {e.code}: {err}")
    assert n >= 20 and not bad, bad


def test_usage_synopsis_matches_the_parser():
    """The synopsis at the top of docs/usage.md names exactly the options each subcommand has."""
    from autoprec.cli_parser import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "cmd").choices  # argparse's own map
    synopsis = next(b for b in _blocks(ROOT / "docs" / "usage.md") if b.lang == "text")
    shown: dict[str, set[str]] = {}
    cmd = ""
    for line in synopsis.code.splitlines():
        m = re.match(r"autoprec (\w+)", line.strip())
        cmd = m.group(1) if m else cmd  # a continuation line belongs to the command above
        shown.setdefault(cmd, set()).update(re.findall(r"(--[\w-]+)", line))
    assert set(shown) == set(subparsers), sorted(shown)
    for cmd, sub in subparsers.items():
        options = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        assert shown[cmd] == options, (cmd, sorted(shown[cmd] ^ options))


_CLI_RUNNER = r'''
import json, shlex, sys
from autoprec.cli import main
for argv in json.load(open(sys.argv[1])):
    print("$", shlex.join(argv), flush=True)
    rc = main(argv[1:])
    if rc:
        print(f"FAILED (exit {rc}): {shlex.join(argv)}", file=sys.stderr)
        sys.exit(1)
'''


def test_cheap_commands_run(tmp_path):
    """The commands on examples/tiny_mlp.py (seconds each, eager) run for real, page by page in
    order, in a scratch directory: each exits 0 and writes what the next reads."""
    cheap = [argv for b, argv in COMMANDS if argv[0] != "make" and any("tiny_mlp" in a for a in argv)]
    assert len(cheap) >= 3, cheap
    work = _scratch(tmp_path)
    (work / "commands.json").write_text(json.dumps(cheap))
    (work / "run_cli.py").write_text(_CLI_RUNNER)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run([sys.executable, "run_cli.py", "commands.json"], cwd=work, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    assert r.stdout.count("$ ") == len(cheap)
