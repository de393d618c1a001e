"""The tree stays ruff-clean (rules in pyproject.toml)."""
import subprocess
import sys
from pathlib import Path


def test_ruff_clean():
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(root)],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_engine_and_script_files_stay_readable():
    """No file in ds4/ or scripts/ is over 600 lines (the model file, in models/, may be longer)."""
    root = Path(__file__).resolve().parent.parent
    files = [p for top in ("ds4", "scripts") for p in sorted((root / top).rglob("*.py"))]
    long = [f"{p.relative_to(root)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > 600]
    assert not long, "\n".join(long)
