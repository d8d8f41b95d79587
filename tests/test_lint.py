"""``ruff check`` over the project passes (pyproject.toml ``[tool.ruff]``: line length, rules, paths)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"ruff check failed (exit {r.returncode}):\n{r.stdout}{r.stderr}"
