"""kvbridge.integrations.forked: a module run under it starts by fork the processes it asks to
spawn, whichever way it asks (SGLang's ``set_start_method``, vLLM's ``get_context``), and gets
its arguments; the other start methods are left as asked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes: the fast tier's are in-process

# A child reports its parent's mark: a forked one inherits the value set at run time, a spawned
# one imports the module afresh and has the default.
HELPER = """
MARK = "imported"

def report(name):
    print(name, MARK, flush=True)
"""

ENGINE = """
import multiprocessing as mp
import sys

import helper

if __name__ == "__main__":
    helper.MARK = "inherited"
    mp.set_start_method("spawn", force=True)  # as SGLang's launcher does
    for name, p in [
        ("set_start_method", mp.Process),
        ("get_context", mp.get_context("spawn").Process),
        ("forkserver", mp.get_context("forkserver").Process),
    ]:
        child = p(target=helper.report, args=(name,))
        child.start()
        child.join(60)
    print("argv", *sys.argv[1:])
"""


def _run(tmp: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    (tmp / "helper.py").write_text(textwrap.dedent(HELPER))
    (tmp / "engine.py").write_text(textwrap.dedent(ENGINE))
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.integrations.forked", *argv],
        cwd=tmp,
        env={"PYTHONPATH": str(tmp), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_spawned_processes_are_forked_and_others_left_as_asked(tmp_path: Path) -> None:
    done = _run(tmp_path, "engine", "--port", "8000")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "set_start_method inherited",
        "get_context inherited",
        "forkserver imported",
        "argv --port 8000",
    ]


@pytest.mark.parametrize("argv", [(), ("--help",)])
def test_without_a_module_it_says_how_to_call_it(tmp_path: Path, argv: tuple[str, ...]) -> None:
    done = _run(tmp_path, *argv)
    assert done.returncode != 0
    assert "usage: python -m kvbridge.integrations.forked MODULE [ARGS]" in done.stderr
