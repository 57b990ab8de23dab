"""An engine server killed by the tests' launch helpers leaves nothing in /dev/shm: its
processes' shared-memory segments (vLLM's message queues, which its SIGKILLed engine never
unlinks) are unlinked after the kill, but not a segment another live process still maps."""

from __future__ import annotations

import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

from kvbridge.integrations.vllm.launch import Server

# A server stand-in: a process of a session of its own (as the helpers start servers) whose
# child maps a segment of its own and one the test made; it prints the first's name.
CHILD = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
own = shared_memory.SharedMemory(create=True, size=1 << 20)
theirs = shared_memory.SharedMemory(name=sys.argv[1])
for s in (own, theirs):  # as a killed engine leaves them: nobody unlinks
    resource_tracker.unregister("/" + s.name, "shared_memory")
print(own.name, flush=True)
time.sleep(600)
"""


def test_a_killed_servers_segments_are_unlinked_and_others_kept(tmp_path: Path) -> None:
    kept = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, kept.name],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None
        own = Path("/dev/shm") / proc.stdout.readline().decode().strip().lstrip("/")
        assert own.exists()
        server = Server("stand-in", 0, proc, tmp_path / "log")
        server.kill()  # (returns once the group is dead and its segments are unlinked)
        assert not own.exists(), "the killed server's own segment was left"
        assert (Path("/dev/shm") / kept.name.lstrip("/")).exists(), (
            "a segment still mapped was removed"
        )
    finally:
        kept.close()
        kept.unlink()
