"""What ``tune --no-compile`` writes about compilation: nothing (docs/policy-file.md, "Rules";
docs/architecture.md#policy-file). It measured no compiled graph, so the file holds no
``compile_options``, is not schema 3, and ``apply``/``train``/``bench`` compile it as
``torch.compile(model)`` would."""

from __future__ import annotations

import json

from autoprec.cli import main
from autoprec.policy import TORCH_COMPILE, Policy
from tests.conftest import EXAMPLES


def test_tune_no_compile_writes_no_compile_options(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["tune", str(EXAMPLES / "tiny_mlp.py"), "--out", str(out), "--trials", "1", "--no-compile",
                 "--dtypes", "bf16", "--traj-steps", "0"]) == 0
    capsys.readouterr()
    d = json.loads(out.read_text())
    pol = Policy.load(out)
    assert "compile_options" not in d and pol.compile_options is None
    assert "batching" not in d
    assert d["schema_version"] == (2 if pol.schema2 else 1)
    assert pol.provenance["compiled"] is False
    assert pol.compiled_as == TORCH_COMPILE  # no say: one flat graph, Inductor's defaults
