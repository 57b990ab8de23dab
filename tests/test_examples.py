"""The README's example runs and says the bytes are equal."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes: the fast tier's are in-process


def test_quickstart_runs() -> None:
    path = Path(__file__).parent.parent / "examples" / "quickstart.py"
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "bytes equal" in done.stdout
