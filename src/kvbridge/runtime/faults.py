"""Test-only fault injection, so that every fault test is deterministic.

Set through ``Settings.faults`` (``KVBRIDGE_FAULTS``) as comma-separated ``name[=value]``:

==================  ==========================================================================
drop_notice=N       drop the N-th chunk-done notice this rank sends (1-based)
dup_notices         send every chunk-done notice twice
reorder_notices     hold each chunk-done notice back and send it after the next one
sender_raise        the prefill transfer worker raises while planning the first chunk
corrupt             flip one source byte after the checksum is taken (integrity mode)
shift_bytes=N       add N to every destination offset that stays in bounds (a head shift)
skip_chunk=N        never send the N-th chunk or layer group (0-based, in the order handed to
                    the sender) of each request; report it anyway
bad_pages           the decode side sends a page id past its pool in its request metadata
malformed           the decode side sends a malformed message before each request's metadata
exit_after_post=N   the prefill process exits (os._exit) right after posting its N-th batch
stop_after_post=N   the prefill process stops itself (SIGSTOP) right after posting its N-th
                    batch: a stall mid-transfer; SIGCONT resumes it
stop_before_post=N  the same right before posting its N-th batch: on SIGCONT the write starts
exit_on_notice=N    the decode process exits (os._exit) when the N-th chunk-done notice reaches
                    it: a decode killed with a request's KV in flight, its prefill holding
                    the request's pages
hold_control=N      the rank's control thread sleeps N seconds at its next tick (or until the
                    rank closes): no heartbeat, message or tick of the rank is handled while
                    the engine's own threads run on
==================  ==========================================================================

``@PATH`` instead of a list: the faults are the file's text, read again at the start of each
request whenever it changed (counters restart then): a test switches a running engine's faults
(one server serves the undisturbed requests and, for a while, the shifted ones) instead of
starting another server for them.

This is the runtime's one fault seam: the production path calls its hooks at named points
(the control channel's ``outgoing``; on a prefill write ``planning``, ``to_write``,
``checksummed``, ``landing``, ``posting``, ``posted``; on a decode request ``request_pages``,
``stray_message``, ``noticed``). With no faults set (the default), every hook is a no-op.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from kvbridge.config import SettingsError
from kvbridge.planner.runs import Runs
from kvbridge.wire.protocol import ChunkDone, Message

log = logging.getLogger("kvbridge.faults")


@dataclass
class Faults:
    drop_notice: int = 0
    dup_notices: bool = False
    reorder_notices: bool = False
    sender_raise: bool = False
    corrupt: bool = False
    shift_bytes: int = 0
    skip_chunk: int = -1
    bad_pages: bool = False
    malformed: bool = False
    exit_after_post: int = 0
    stop_after_post: int = 0
    stop_before_post: int = 0
    exit_on_notice: int = 0
    hold_control: int = 0
    # Counters of what was injected so far; mutable on purpose, behind the lock.
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)
    _held: dict[str, Message] = field(default_factory=dict, compare=False, repr=False)
    _notices: int = field(default=0, compare=False, repr=False)
    _posts: int = field(default=0, compare=False, repr=False)
    _received: int = field(default=0, compare=False, repr=False)
    _held_control: bool = field(default=False, compare=False, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)
    # ``@PATH``: the file the faults are read from, and the text last read from it.
    _source: Path | None = field(default=None, compare=False, repr=False)
    _text: str = field(default="", compare=False, repr=False)

    @classmethod
    def from_setting(cls, setting: str) -> Faults:
        """``Settings.faults``: a list of faults, or ``@PATH`` (the file's, as it changes)."""
        if not setting.startswith("@"):
            return cls.parse(setting)
        faults = cls(_source=Path(setting[1:]))
        faults.refresh(strict=True)
        return faults

    def refresh(self, *, strict: bool = False) -> None:
        """At the start of a request: the source file's faults, where they changed. A file
        that cannot be read (not there yet, removed) means no faults; one that does not parse
        is refused at start-up (``strict``), and later logged and ignored (no request fails
        for a test's typo)."""
        if self._source is None:
            return
        try:
            text = self._source.read_text().strip()
        except OSError:
            text = ""
        if text == self._text:
            return
        try:
            self.reset(text)
        except SettingsError as e:
            if strict:
                raise SettingsError(f"faults file {self._source}: {e}") from None
            log.warning("faults file %s ignored: %s", self._source, e)
        self._text = text

    @classmethod
    def parse(cls, text: str) -> Faults:
        known = {f.name: f.type for f in fields(cls) if not f.name.startswith("_")}
        values: dict[str, object] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, sep, raw = item.partition("=")
            if name not in known:
                raise SettingsError(f"unknown fault {name!r}; known: {sorted(known)}")
            try:
                values[name] = int(raw) if known[name] == "int" else (not sep or raw != "0")
            except ValueError:
                raise SettingsError(f"fault {name}={raw!r}: expected an integer") from None
        return cls(**values)  # type: ignore[arg-type]

    def reset(self, text: str) -> None:
        """Inject ``text``'s faults from now on, counting afresh (a chaos soak changes a
        running rank's faults between rounds); notices held back are dropped."""
        fresh = Faults.parse(text)
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_"):
                    setattr(self, f.name, getattr(fresh, f.name))
            self._notices = self._posts = self._received = 0
            self._held_control = False
            self._held.clear()

    # ---- the control channel ---------------------------------------------------------------

    @property
    def on_notices(self) -> bool:
        """Whether a fault acts on chunk notices as the control channel sends them: then
        they all go that way, never carried with the writes."""
        return bool(self.drop_notice or self.dup_notices or self.reorder_notices)

    def outgoing(self, peer: str, msg: Message) -> list[Message]:
        """What actually leaves for ``peer`` when the engine sends it ``msg``."""
        if not isinstance(msg, ChunkDone) or not self.on_notices:
            return [msg]
        with self._lock:
            self._notices += 1
            if self._notices == self.drop_notice:
                return []
            if self.dup_notices:
                return [msg, msg]
            held = self._held.pop(peer, None)
            if held is None:
                self._held[peer] = msg
                return []
            return [msg, held]

    def flush_held(self) -> list[tuple[str, Message]]:
        """Notices still held back by ``reorder_notices``: (peer, message) to send now (after
        a request's last notice, which must not wait for a next one)."""
        with self._lock:
            out = list(self._held.items())
            self._held.clear()
        return out

    # ---- the prefill write path, in the order a write meets them -----------------------

    def planning(self, index: int) -> None:
        """``sender_raise``: the worker raises planning a request's first chunk."""
        if self.sender_raise and index == 0:
            raise RuntimeError("injected fault: the sender raised inside its worker")

    def to_write(self, first: int, taken: int, runs: Runs) -> Runs:
        """``skip_chunk``: the runs of a write carrying chunks or layer groups ``[first,
        first + taken)``, none where it carries the skipped one (reported all the same)."""
        return Runs.empty() if first <= self.skip_chunk < first + taken else runs

    def checksummed(
        self, runs: Runs, src_regions: tuple[str, ...], views: Mapping[str, np.ndarray]
    ) -> None:
        """``corrupt``: a source byte flipped after its checksum was taken."""
        if self.corrupt and len(runs):
            views[src_regions[int(runs.src_region[0])]][int(runs.src_offset[0])] ^= 0xFF

    def landing(self, runs: Runs, dst_regions: tuple[str, ...], sizes: Mapping[str, int]) -> Runs:
        """``shift_bytes``: every destination moved by N bytes where it stays in its region."""
        by = self.shift_bytes
        if not by:
            return runs
        limit = np.array([sizes[dst_regions[int(r)]] for r in runs.dst_region], dtype=np.int64)
        end = runs.dst_offset + by + (runs.count - 1) * runs.dst_stride + runs.nbytes
        off = np.where(end <= limit, runs.dst_offset + by, runs.dst_offset)
        return Runs(
            runs.src_region,
            runs.src_offset,
            runs.dst_region,
            off,
            runs.nbytes,
            runs.count,
            runs.src_stride,
            runs.dst_stride,
        )

    def posting(self) -> int:
        """Before a write is posted: its number (0 when posts are not counted); stalls the
        process before the ``stop_before_post``-th."""
        if not (self.exit_after_post or self.stop_after_post or self.stop_before_post):
            return 0
        with self._lock:
            self._posts += 1
            n = self._posts
        if n == self.stop_before_post:
            stall_here()  # the fault: a stall, a write about to start
        return n

    def posted(self, n: int) -> None:
        """Write ``n`` is in flight: the process dies or stalls here, if told to."""
        if n and n == self.exit_after_post:
            os._exit(3)  # the fault: this process dies with the write in flight
        if n and n == self.stop_after_post:
            stall_here()  # the fault: a stall, write in flight

    # ---- the decode request ------------------------------------------------------------

    def request_pages(self, pages: dict[str, list[int]]) -> dict[str, list[int]]:
        """``bad_pages``: the request's metadata names a page past the pool."""
        if self.bad_pages and pages:
            g = next(iter(pages))
            pages = {**pages, g: [*pages[g][:-1], 1 << 40]}
        return pages

    def stray_message(self) -> bytes | None:
        """``malformed``: raw bytes sent before each request's metadata."""
        return b"\x81\xa4type\xa7unknown" if self.malformed else None

    def noticed(self) -> None:
        """A chunk-done notice arrived: the process dies here, if told to (its prefill wrote
        the chunk and holds the request's pages until the request ends)."""
        if not self.exit_on_notice:
            return
        with self._lock:
            self._received += 1
            n = self._received
        if n == self.exit_on_notice:
            os._exit(3)  # the fault: this decode dies with the request's KV in flight

    # ---- the control thread ----------------------------------------------------------------

    def ticking(self) -> None:
        """``hold_control``: the control thread's next tick once it is set sleeps (a handler
        or a C call holding it up), until :meth:`release` where the rank closes first."""
        if not self.hold_control:  # every tick asks: no lock where the fault is off
            return
        with self._lock:
            if self._held_control:
                return
            self._held_control = True
        log.warning("injected fault: the control thread held for %d s", self.hold_control)
        self._released.wait(self.hold_control)

    def release(self) -> None:
        """The rank closes: a held control thread goes on (and stops)."""
        self._released.set()


def stall_here() -> None:
    """Stop this whole process (SIGSTOP) before the calling thread runs another instruction.

    A stop sent to the process (``kill(getpid())``) is taken by whichever thread the kernel
    picks; on a loaded host the caller can run on for milliseconds, long enough to post and
    finish the very write the stall was meant to hold. Sent to the calling thread, the caller
    takes it on its way out of the system call and the whole group stops with it."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
