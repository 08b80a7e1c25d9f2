import subprocess
import sys

from conftest import ROOT


def test_ruff_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:]
