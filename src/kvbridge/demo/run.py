"""One demo case as a deployment on this host, and its check.

:class:`Runner` owns a fork server that has imported torch and transformers once (a fresh
interpreter per rank would pay several seconds of imports each), runs the undisturbed
reference of each (model, prompt) once, and runs cases: a :class:`~kvbridge.bootstrap.
BootstrapServer` and one process per prefill and decode rank, as :mod:`kvbridge.deploy.cluster`
does. The parent process imports torch only to prove a user's config before any process starts
(:func:`kvbridge.demo.forward.prove`, called by :func:`kvbridge.demo.matrix.cells`).

A case passes when the decode side's tokens equal the reference's and every HF cache tensor
the decode side rebuilt equals the reference's bit for bit (and replicas held by several decode
ranks agree). "Bytes moved" is what the plans of all chunks carry; GB/s is those bytes over the
longest send of a prefill rank (its first chunk handed to kvbridge to its request's success:
every write done and reported); TTFT is from the request's start on every rank (prefill ranks
start computing, decode ranks ask for it) to the first token the decode side computes.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvbridge.demo import diagnosis
from kvbridge.demo.deployment import (
    IDLE,
    Job,
    build_side,
    chunks,
    placement,
    prefill_chunk,
    with_window_pools,
)
from kvbridge.demo.models import ModelCase, get_case, tokenizer
from kvbridge.deploy import shield
from kvbridge.errors import LayoutError, SpecError
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.plan import Pairing
from kvbridge.planner.sidespec import SideOptions


def logged(trace: str) -> str:
    """A worker's traceback kept in a log file; what to print instead, on one line: the
    error it ended with, and the file."""
    where = tempfile.mkdtemp(prefix=f"kvbridge-demo-{os.getpid()}-")
    path = os.path.join(where, "worker.log")
    with open(path, "w") as f:
        f.write(trace)
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    return f"raised {lines[-1] if lines else 'an error'} (full log: {path})"


DEFAULT_PROMPT = (
    "Disaggregated serving moves the KV cache from the prefill ranks to the "
    "decode ranks; every byte must land where the plan says."
)
DEFAULT_NEW_TOKENS = 16
DEFAULT_CHUNK = 32
SEED = 1234

# name -> (prefill side, decode side), as ``kvbridge plan`` takes them
TOPOLOGIES: dict[str, tuple[str, str]] = {
    "tp4-tp1": ("tp=4,page=16", "tp=1,page=16"),
    "tp1-tp4": ("tp=1,page=16", "tp=4,page=16"),
    "tp2-tp1": ("tp=2,page=16", "tp=1,page=16"),
    "tp1-tp2": ("tp=1,page=16", "tp=2,page=16"),
    "tp2-tp3": ("tp=2,page=16", "tp=3,page=16"),
    "pp2-pp1": ("tp=1,pp=2,page=16", "tp=1,page=16"),
    "page64-16": ("tp=2,page=64", "tp=2,page=16"),
    "nhd-hnd": ("tp=2,page=16,layout=nhd", "tp=2,page=16,layout=hnd"),
    # Context parallel prefill: each CP group computes and holds its own pieces of the prompt.
    "cp2-tp2": ("tp=1,cp=2,tokens=zigzag,page=16", "tp=2,page=16"),
    "cp2xtp2-tp1": ("tp=2,cp=2,tokens=contiguous,page=16", "tp=1,page=16"),
    # vLLM's decode context parallel: the decode ranks' copies of the latent split its tokens.
    "tp1-dcp2": ("tp=1,page=16", "tp=2,dcp=2,tokens=interleaved,interleave=16,page=16"),
    # Attention DP on both sides: the request lives in one group of each; the decode side
    # learns the prefill group from the bootstrap service.
    "dp2-dp2": ("dp=2,tp=2,page=16", "dp=2,tp=1,page=16"),
}


def parse_topology(text: str) -> tuple[str, SideOptions, SideOptions]:
    """A topology name, or ``PREFILL->DECODE`` side options (``tp=4,page=64->tp=1``)."""
    if text in TOPOLOGIES:
        p, d = TOPOLOGIES[text]
    elif "->" in text:
        p, d = text.split("->", 1)
    else:
        raise LayoutError(
            f"unknown topology {text!r}; expected one of {', '.join(TOPOLOGIES)} "
            f"or PREFILL->DECODE side options like 'tp=4,page=64->tp=1'"
        )
    return text, SideOptions.parse(p), SideOptions.parse(d)


def prompt_tokens(text: str, case: ModelCase | None = None) -> tuple[int, ...]:
    """The prompt as ``case``'s tokens: its tokenizer's where it has one (a saved model's),
    else the demo's tokenizer: the prompt's UTF-8 bytes (a random-weight model's vocabulary is
    256 tokens)."""
    if case is not None and case.tokenizer:
        ids = tuple(tokenizer(case).encode(text).ids)
    else:
        ids = tuple(text.encode("utf-8"))
    vocab = case.config.get("vocab_size") if case is not None and case.weights else None
    if case is not None and not case.tokenizer and isinstance(vocab, int) and vocab < 256:
        raise SpecError(
            f"{case.name}: without a tokenizer.json the prompt's bytes are its tokens, which "
            f"a vocabulary of {vocab} cannot hold"
        )
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def prompt_text(case: ModelCase, tokens: tuple[int, ...]) -> str | None:
    """Generated tokens as text, where the case has a tokenizer."""
    return tokenizer(case).decode(list(tokens)) if case.tokenizer else None


@dataclass(frozen=True)
class Reference:
    spec: CacheSpec
    digest: str
    tokens: list[int]
    snapshot: dict[str, np.ndarray] = field(repr=False)


@dataclass(frozen=True)
class CaseResult:
    model: str
    topology: str
    transport: str
    tokens_equal: bool
    cache_equal: bool
    bytes_moved: int = 0
    send_seconds: float | None = None
    ttft: float | None = None
    seconds: float = 0.0
    tokens: tuple[int, ...] = ()
    expected: tuple[int, ...] = ()
    sends: int = 0  # the most send() calls of a prefill rank (one per layer group and chunk)
    problem: str = ""  # why not equal, or what failed

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.cache_equal

    @property
    def gbps(self) -> float | None:
        if not self.send_seconds or not self.bytes_moved:
            return None
        return self.bytes_moved / self.send_seconds / 1e9


def entry(role: str, *args: Any) -> None:
    """Process target (importable without torch); the fork server has the workers loaded.
    A rank answers the runner's questions of a case that gave no result (:mod:`.diagnosis`)."""
    if role in ("prefill", "decode"):
        diagnosis.arm()
    from kvbridge.demo import workers

    if role == "prefill":
        workers.prefill_main(*args)
    elif role == "decode":
        workers.decode_main(*args)
    else:
        workers.reference_main(*args)


class Runner:
    """Runs cases; keeps the fork server and the references between them."""

    def __init__(
        self,
        *,
        timeout: float = 60.0,
        chunk: int = DEFAULT_CHUNK,
        seed: int = SEED,
        device: str = "cpu",
    ) -> None:
        """``device``: where every process runs the model and keeps its pools (cpu, cuda or
        cuda:I); on a device the transport must move device memory (cudaipc, tcp,
        nixl, mooncake)."""
        self.timeout, self.chunk, self.seed, self.device = timeout, chunk, seed, device
        self.ctx: Any = shield.fork_context()
        self._refs: dict[tuple[str, tuple[int, ...], int, int], Reference] = {}

    def chunk_of(
        self, case: ModelCase, prompt: tuple[int, ...], prefill: SideOptions | None = None
    ) -> int:
        """The prefill chunk (the reference's too): the runner's; the whole prompt for a model
        that cannot continue a chunk; piece-aligned for a context-parallel prefill side."""
        cp = prefill is not None and prefill.token_map().shards > 1
        if not case.chunked:
            if cp:
                raise SpecError(
                    f"{case.name} prefills its prompt in one forward (HF cannot "
                    f"continue a chunk of it), so it cannot prefill context "
                    f"parallel"
                )
            return len(prompt)
        return (
            prefill_chunk(prefill, len(prompt), self.chunk)
            if prefill is not None and cp
            else self.chunk
        )

    def reference(
        self,
        model: ModelCase | str,
        prompt: tuple[int, ...],
        new_tokens: int,
        chunk: int | None = None,
    ) -> Reference:
        case = get_case(model)
        chunk = self.chunk_of(case, prompt) if chunk is None else chunk
        key = (repr(case), prompt, new_tokens, chunk)
        if key not in self._refs:
            out = self.ctx.Queue()
            p = self.ctx.Process(
                target=entry,
                args=("reference", case, self.seed, prompt, new_tokens, chunk, out, self.device),
            )
            limit = self.timeout + 60  # the first one waits for the server
            end = time.monotonic() + limit
            with shield.running(p):
                while True:
                    try:
                        msg = out.get(timeout=0.1)
                        break
                    except queue.Empty:
                        if p.exitcode is not None:
                            raise RuntimeError(
                                f"{case.name}: the reference run ended without an "
                                f"answer (exit code {p.exitcode})"
                            ) from None
                        if time.monotonic() > end:
                            raise RuntimeError(
                                f"{case.name}: the reference run gave no answer within "
                                f"{limit:.0f} s (a larger --timeout gives it longer)"
                            ) from None
            if msg[0] == "refused":
                raise SpecError(msg[1])
            if msg[0] == "error":
                raise RuntimeError(f"{case.name}: the reference run {logged(msg[3])}")
            self._refs[key] = Reference(**msg[1])
        return self._refs[key]

    def run(
        self,
        model: ModelCase | str,
        topology: str,
        transport: str,
        *,
        prompt: str = DEFAULT_PROMPT,
        new_tokens: int = DEFAULT_NEW_TOKENS,
        prefill_settings: dict[str, Any] | None = None,
        decode_settings: dict[str, Any] | None = None,
        forget_handover: bool = False,
    ) -> CaseResult:
        """One case. ``forget_handover`` (tests only): context-parallel prefill ranks compute
        their pieces without the KV of the tokens before them."""
        if new_tokens < 2:
            raise ValueError("--new-tokens must be >= 2: the first token comes from prefill")
        case = get_case(model)
        ids = prompt_tokens(prompt, case)
        name, po, do = parse_topology(topology)
        chunk = self.chunk_of(case, ids, po)
        ref = self.reference(case, ids, new_tokens, chunk)
        po, do = with_window_pools(ref.spec, po, do)
        pairing = Pairing(build_side(ref.spec, po, len(ids)), build_side(ref.spec, do, len(ids)))
        src = placement(ref.spec, po, len(ids), decode=False)
        dst = placement(ref.spec, do, len(ids), decode=True)
        moved = sum(pairing.plan(src, dst, s, e).total_bytes for s, e in chunks(len(ids), chunk))
        job = Job(
            case,
            self.seed,
            ref.digest,
            ids,
            new_tokens,
            chunk,
            po,
            do,
            transport,
            self.timeout,
            prefill_settings or {},
            decode_settings or {},
            forget_handover,
            self.device,
        )
        t0 = time.monotonic()
        decode_world = pairing.decode.parallel.world
        results, problem, t_go = self._deploy(
            job, po.dp * pairing.prefill.parallel.world, do.dp * decode_world
        )
        return _judge(
            case.name,
            name,
            transport,
            ref,
            results,
            problem,
            moved,
            t_go,
            time.monotonic() - t0,
            head=job.decode_group * decode_world,
        )

    def _deploy(
        self, job: Job, prefill_procs: int, decode_procs: int
    ) -> tuple[dict[tuple[str, int], dict[str, Any]], str, float]:
        """One process per rank of every DP group of each side."""
        from kvbridge.bootstrap import BootstrapServer

        ctx = self.ctx
        out, gather, go, stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
        inboxes = [ctx.Queue() for _ in range(prefill_procs)]  # context-parallel hand-overs
        results: dict[tuple[str, int], dict[str, Any]] = {}
        problem, t_go = "", 0.0
        with BootstrapServer() as server:
            procs = {
                ("prefill", r): ctx.Process(
                    target=entry, args=("prefill", job, r, server.address, out, go, stop, inboxes)
                )
                for r in range(prefill_procs)
            }
            procs.update(
                {
                    ("decode", r): ctx.Process(
                        target=entry, args=("decode", job, r, server.address, out, go, stop, gather)
                    )
                    for r in range(decode_procs)
                }
            )
            with diagnosis.removing(procs.values()), shield.running(*procs.values(), grace=5):
                ready: set[tuple[str, int]] = set()
                end = time.monotonic() + self.timeout
                try:
                    while len(results) < len(procs) and time.monotonic() < end:
                        dead = [
                            k
                            for k, p in procs.items()
                            if p.exitcode is not None and k not in results
                        ]
                        try:
                            msg = out.get(timeout=0.05)
                        except queue.Empty:
                            if dead:
                                problem = (
                                    f"{dead[0][0]} rank {dead[0][1]} died (exit code "
                                    f"{procs[dead[0]].exitcode})"
                                )
                                break
                            continue
                        key = (msg[1], msg[2])
                        if msg[0] == "ready":
                            ready.add(key)
                            if len(ready) == len(procs):
                                t_go = time.monotonic()
                                go.set()
                        elif msg[0] == "result":
                            results[key] = msg[3]
                        elif msg[0] == "error":
                            problem = f"{key[0]} rank {key[1]} {logged(msg[3])}"
                            break
                    else:
                        if len(results) < len(procs):
                            missing = sorted(set(procs) - set(results))
                            when = (
                                f"the request started {t_go - end + self.timeout:.1f} s in"
                                if t_go
                                else f"never ready: {sorted(set(procs) - ready)}"
                            )
                            problem = (
                                f"no result within {self.timeout:.0f} s from {missing} "
                                f"({when}){diagnosis.ask({k: procs[k] for k in missing})}"
                            )
                finally:
                    stop.set()
                    go.set()
        return results, problem, t_go


def _judge(
    model: str,
    topology: str,
    transport: str,
    ref: Reference,
    results: dict[tuple[str, int], dict[str, Any]],
    problem: str,
    moved: int,
    t_go: float,
    seconds: float,
    head: int = 0,
) -> CaseResult:
    """``head``: the decode process that generated (rank 0 of the request's DP group)."""
    from kvbridge.demo.cache_io import compare

    base = CaseResult(
        model, topology, transport, False, False, moved, seconds=seconds, expected=tuple(ref.tokens)
    )
    if problem:
        return replace(base, problem=problem)
    busy = {k: r for k, r in results.items() if r["state"] != IDLE}
    failed = {k: r["failure"] or r["state"] for k, r in busy.items() if r["state"] != "SUCCESS"}
    if failed:
        return replace(base, problem=f"transfer failed: {failed}")
    got = results[("decode", head)]
    if "problem" in got:
        return replace(base, problem=got["problem"])
    tokens = tuple(got["tokens"])
    diff = compare(ref.snapshot, got["snapshot"])
    problems = [*got["problems"], *([diff] if diff else [])]
    send = max(r["send_seconds"] for k, r in busy.items() if k[0] == "prefill")
    sends = max(r["sends"] for k, r in busy.items() if k[0] == "prefill")
    ttft = got["first_decoded"] - t_go if got["first_decoded"] else None
    if tokens != tuple(ref.tokens):
        problems.append(f"tokens {list(tokens)} != reference {ref.tokens}")
    return replace(
        base,
        tokens_equal=tokens == tuple(ref.tokens),
        cache_equal=not got["problems"] and diff is None,
        send_seconds=send,
        ttft=ttft,
        tokens=tokens,
        sends=sends,
        problem="; ".join(problems),
    )
