"""The tree stays ruff-clean (rules in pyproject.toml)."""
import subprocess
import sys
from pathlib import Path


def test_ruff_clean():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(root)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
