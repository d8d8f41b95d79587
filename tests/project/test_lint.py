"""``ruff check`` over the project passes (pyproject.toml ``[tool.ruff]``: line length, rules, paths)."""
import subprocess
import sys

from tests.conftest import ROOT


def test_ruff_check_passes():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"ruff check failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"
