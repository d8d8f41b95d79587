"""docs/architecture.md's "Public API" listing against the package: every call it lists names a
public function of ``autoprec`` with its parameters in order and the defaults it really has, and every
method it names exists. The listing is not run as an example (``tests/project/test_docs.py``'s ``NOT_RUN``:
``apply(compile=True)`` and ``tune()`` take minutes on a CPU); this is what keeps it true."""

from __future__ import annotations

import ast
import inspect
import re

import autoprec
from tests.conftest import ROOT

ARCH = ROOT / "docs" / "architecture.md"


def _listing() -> str:
    text = ARCH.read_text(encoding="utf-8")
    m = re.search(r"^## Public API\n\n```python\n(.*?)^```", text, re.M | re.S)
    assert m, "docs/architecture.md has no ```python block under '## Public API'"
    return m.group(1)


def _resolve(node: ast.expr):
    """The object an ``autoprec.X`` / ``autoprec.X.Y`` attribute chain names, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "autoprec"):
        return None, ""
    obj = autoprec
    for name in reversed(parts):
        obj = getattr(obj, name)
    return obj, "autoprec." + ".".join(reversed(parts))


def _calls():
    """``(qualified name, object, ast.Call)`` of every ``autoprec.*(...)`` call in the listing."""
    out = []
    for node in ast.walk(ast.parse(_listing())):
        if isinstance(node, ast.Call):
            obj, name = _resolve(node.func)
            if obj is not None:
                out.append((name, obj, node))
    return out


def _mismatches(name: str, obj, call: ast.Call) -> list[str]:
    sig = inspect.signature(obj)
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    bad = []
    for i, arg in enumerate(call.args):
        if i >= len(params):
            bad.append(f"{name}: positional argument {i} has no parameter")
        elif isinstance(arg, ast.Name) and arg.id != params[i].name and params[i].name not in (
                "path", "model_path"):
            bad.append(f"{name}: argument {i} is {params[i].name!r}, the listing says {arg.id!r}")
    given = {p.name for p in params[:len(call.args)]}
    for kw in call.keywords:
        p = sig.parameters.get(kw.arg)
        if p is None:
            bad.append(f"{name}: no parameter {kw.arg!r}")
            continue
        given.add(kw.arg)
        value = eval(compile(ast.Expression(kw.value), name, "eval"), {})  # literals, 2.0**16
        if p.default is inspect.Parameter.empty:
            bad.append(f"{name}: {kw.arg} has no default, the listing gives {value!r}")
        elif p.default != value:
            bad.append(f"{name}: {kw.arg} defaults to {p.default!r}, the listing says {value!r}")
    missing = [p.name for p in params if p.name not in given]
    if missing and len(call.args) + len(call.keywords) > 1:  # a full signature: every parameter named
        bad.append(f"{name}: the listing leaves out {missing}")
    return bad


def test_listing_calls_match_the_signatures():
    calls = _calls()
    names = {n for n, _, _ in calls}
    # the entry points the README and docs/usage.md teach are all in the listing
    assert {"autoprec.capture", "autoprec.apply", "autoprec.tune", "autoprec.make_scaler", "autoprec.ddp",
            "autoprec.shard", "autoprec.DynamicLossScaler", "autoprec.Monitor", "autoprec.save_checkpoint",
            "autoprec.load_checkpoint", "autoprec.Policy.default", "autoprec.Policy.load"} <= names, names
    bad = [m for name, obj, call in calls for m in _mismatches(name, obj, call)]
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_wrong_default():
    """The comparison fails on a default the package does not have (so the test above can fail)."""
    call = ast.parse("autoprec.tune(model_path, trials=7)").body[0].value
    assert any("trials defaults to None" in m for m in _mismatches("autoprec.tune", autoprec.tune, call))
    call = ast.parse("autoprec.apply(model, policy, example_batch, compile=True, colour=1)").body[0].value
    assert any("no parameter 'colour'" in m for m in _mismatches("autoprec.apply", autoprec.apply, call))


def test_listed_methods_exist():
    """The scaler methods the comment lines list, and the names of 'Also exported', are real."""
    text = _listing()
    comments = [line for line in text.splitlines() if line.startswith(("# scale(", "# state_dict"))]
    methods = re.findall(r"(\w+)\(([\w, ]*)\)", " ".join(comments))
    assert methods
    for name, args in methods:  # each takes the arguments it is shown with, no more, no fewer
        params = [a.strip() for a in args.split(",") if a.strip()]
        inspect.signature(getattr(autoprec.DynamicLossScaler, name)).bind("self", *params)
    also = re.search(r"Also exported: (.*?)\. The CLI", ARCH.read_text(encoding="utf-8"), re.S).group(1)
    names = re.findall(r"`(\w+)`", also)
    assert names and all(n in autoprec.__all__ for n in names), names
