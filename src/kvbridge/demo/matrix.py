"""``kvbridge demo``: a matrix of models x topologies, progress while it runs, one table at the end.

With no options every model runs its own topologies (:attr:`ModelCase.topologies`: together
they cover TP 4 -> 1, 1 -> 4, 2 -> 3, PP 2 -> 1, page 64 -> 16 and NHD -> HND on both embedded
cross-process transports). ``--model`` keeps one model (a built-in name, or a Hugging Face
config: see :mod:`kvbridge.demo.configs`), ``--topology`` one topology (run on every chosen model
whose heads fit it), ``--transport`` puts every case on one transport.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbridge.demo.configs import case_from_config
from kvbridge.demo.forward import describe, proven
from kvbridge.demo.models import CASES, ModelCase
from kvbridge.demo.run import (
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT,
    CaseResult,
    Runner,
    parse_topology,
    prompt_text,
    prompt_tokens,
)
from kvbridge.errors import IncompatibleError, KVBridgeError, LayoutError, SpecError
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.sidespec import SideOptions

_TP_SIZES = range(1, 17)  # what "the valid TP sizes" lists


@dataclass(frozen=True)
class Cell:
    case: ModelCase
    topology: str
    transport: str

    @property
    def model(self) -> str:
        return self.case.name


def models(model: str | None, full_size: bool = False) -> list[ModelCase]:
    """Every built-in case, one by name, or the model of a config file."""
    if model is not None and model not in CASES:
        return [case_from_config(model, full_size=full_size)]
    if full_size:
        raise SpecError(
            "--full-size applies to a model given as a config file; the built-in "
            "models are small on purpose"
        )
    return [CASES[model]] if model is not None else list(CASES.values())


_ON_DEVICE = {"shm": "cudaipc"}


def cells(
    model: str | None = None,
    topology: str | None = None,
    transport: str | None = None,
    full_size: bool = False,
    on_device: bool = False,
) -> list[Cell]:
    """The cases to run for these options (see the module docstring). ``on_device``: each
    case's own transport, where it is not given, is one that moves device memory (shm's
    counterpart on one host is cudaipc; tcp goes through pinned host memory)."""
    chosen = models(model, full_size)
    if topology is not None:
        parse_topology(topology)  # a clear error now, not in a worker
    out = []
    for case in chosen:
        pairs = case.topologies
        users = model is not None and model not in CASES
        # A user's config: its cache described from the config (refused here if it cannot
        # be), its layout checked against that, then the model built and run on a few tokens
        # (forward.prove), all before any process starts.
        described = describe(case) if users else None
        if topology is not None:
            pairs = ((topology, pairs[0][1]),)
            if model is not None:  # the user's own model and layout: refuse a misfit now
                check_topology(case, topology, described)
        if users and model is not None:
            case, _ = proven(case, functools.partial(case_from_config, model, tie_width=True))
        out += [
            Cell(case, t, transport or (_ON_DEVICE.get(tr, tr) if on_device else tr))
            for t, tr in pairs
        ]
    return out


def check_topology(case: ModelCase, topology: str, spec: CacheSpec | None = None) -> None:
    """Raise LayoutError, listing the TP sizes that fit, if the model's heads (or groups)
    cannot be sharded over either side of ``topology``, IncompatibleError if the two sides do
    not pair (DeepSeek V4's compressed entries on a context-parallel side). Decided from the
    config alone (before any process starts): by :mod:`kvbridge.model.hf` where it knows the
    architecture, else by ``spec`` (the demo's description of the cache,
    :func:`kvbridge.demo.forward.describe`)."""
    from kvbridge.demo.deployment import build_side, with_window_pools
    from kvbridge.model.hf import spec_from_config, supported_model_types
    from kvbridge.planner.plan import Pairing

    if case.model_type in supported_model_types():
        spec = spec_from_config({"model_type": case.model_type, **case.config}, name=case.name)
    if spec is None:
        return  # the reference run decides (see _fits)
    _, po, do = parse_topology(topology)
    po, do = with_window_pools(spec, po, do)
    sides = []
    for side, opts in (("prefill", po), ("decode", do)):
        try:
            sides.append(build_side(spec, opts, 64))
        except LayoutError as e:
            fits = _valid_tp(spec, opts)
            raise LayoutError(
                f"{case.name}: the {side} side cannot take tp={opts.tp}: {e}; "
                f"TP sizes that fit this model: "
                f"{', '.join(map(str, fits)) or 'none'}"
            ) from None
    try:
        Pairing(*sides)
    except IncompatibleError as e:
        raise IncompatibleError(f"{case.name}: {topology}: {e}") from None


def _valid_tp(spec: CacheSpec, opts: SideOptions) -> list[int]:
    from kvbridge.demo.deployment import build_side

    fits = []
    for tp in _TP_SIZES:
        try:
            build_side(spec, replace(opts, tp=tp), 64)
        except LayoutError:
            continue
        fits.append(tp)
    return fits


def _fits(runner: Runner, cell: Cell, prompt: str, new_tokens: int) -> str | None:
    """None if the model's heads can be sharded over both sides' TP sizes and the two sides
    pair (DeepSeek V4's compressed entries with no context parallelism), else why not."""
    from kvbridge.demo.deployment import build_side, with_window_pools
    from kvbridge.planner.plan import Pairing

    ids = prompt_tokens(prompt, cell.case)
    spec = runner.reference(cell.case, ids, new_tokens).spec
    _, po, do = parse_topology(cell.topology)
    po, do = with_window_pools(spec, po, do)
    try:
        Pairing(build_side(spec, po, len(ids)), build_side(spec, do, len(ids)))
    except KVBridgeError as e:
        return str(e)
    return None


def _mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[bold red]NO[/bold red]"


def table(results: list[CaseResult], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "model",
        "topology",
        "transport",
        "tokens equal",
        "cache equal",
        "bytes moved",
        "GB/s",
        "TTFT (decoded)",
        "time",
    ):
        t.add_column(
            col,
            justify="right" if col in ("bytes moved", "GB/s", "TTFT (decoded)", "time") else "left",
        )
    for r in results:
        gbps = r.gbps
        t.add_row(
            r.model,
            r.topology,
            r.transport,
            _mark(r.tokens_equal),
            _mark(r.cache_equal),
            f"{r.bytes_moved:,}",
            f"{gbps:.4f}" if gbps is not None else "-",
            f"{r.ttft * 1000:.0f} ms" if r.ttft is not None else "-",
            f"{r.seconds:.1f} s",
        )
    return t


def run_demo(
    model: str | None = None,
    topology: str | None = None,
    transport: str | None = None,
    prompt: str = DEFAULT_PROMPT,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    console: Console | None = None,
    faults: str = "",
    full_size: bool = False,
    device: str = "cpu",
    timeout: float = 60.0,
) -> int:
    """Run the matrix; print progress and the table. 0 if every case matched, 1 if one did
    not, 2 if no case fits the options. ``device``: where the models and pools are (cpu,
    cuda[:I]); on a device a case's shm runs on cudaipc, its tcp on tcp (pinned memory).
    ``faults`` (tests only) sets :mod:`kvbridge.runtime.faults` hooks on every prefill rank.
    ``timeout``: seconds a case's processes may take to answer (:class:`.run.Runner`)."""
    console = console or Console(width=None if Console().is_terminal else 120)
    if not prompt or new_tokens < 2:
        console.print(
            "[red]error:[/red] the prompt must not be empty and --new-tokens must be "
            ">= 2 (the first token is sampled by prefill)",
            highlight=False,
        )
        return 2
    on_device = device != "cpu"
    todo = cells(model, topology, transport, full_size, on_device)
    runner = Runner(timeout=timeout, device=device)
    results: list[CaseResult] = []
    skipped: list[str] = []
    t0 = time.monotonic()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("starting the fork server (imports torch once)", total=len(todo))
        for cell in todo:
            progress.update(task, description=f"{cell.model} {cell.topology} {cell.transport}")
            try:
                why = _fits(runner, cell, prompt, new_tokens)
                r = (
                    None
                    if why is not None
                    else runner.run(
                        cell.case,
                        cell.topology,
                        cell.transport,
                        prompt=prompt,
                        new_tokens=new_tokens,
                        prefill_settings={"faults": faults} if faults else None,
                    )
                )
            except SpecError as e:  # a model the demo cannot run: refused, with the reason
                why, r = str(e), None
            except (KVBridgeError, RuntimeError, TimeoutError, ValueError) as e:
                why, r = (
                    None,
                    CaseResult(
                        cell.model,
                        cell.topology,
                        cell.transport,
                        False,
                        False,
                        problem=f"{type(e).__name__}: {e}",
                    ),
                )
            if r is None:
                skipped.append(f"{cell.model} {cell.topology}: {why}")
            else:
                results.append(r)
                if not r.ok:
                    progress.console.print(
                        f"[red]mismatch[/red] {cell.model} {cell.topology} "
                        f"{cell.transport}: {r.problem}",
                        highlight=False,
                    )
            progress.advance(task)
        progress.update(task, description="done")
    for s in skipped:
        console.print(f"[yellow]skipped[/yellow] {s}", highlight=False)
    if not results:
        console.print("[red]error:[/red] no case fits these options", highlight=False)
        return 2
    console.print(
        table(
            results,
            f"kvbridge demo: {len(prompt_tokens(prompt, todo[0].case))}-token prompt, "
            f"{new_tokens} new tokens, float32 on {device if on_device else 'CPU'}",
        )
    )
    bad = [r for r in results if not r.ok]
    console.print(
        f"{len(results) - len(bad)} of {len(results)} cases token-exact and "
        f"cache-bitwise in {time.monotonic() - t0:.0f} s",
        highlight=False,
    )
    if not bad:
        sample = results[0]
        console.print(f"e.g. {sample.model} generated {list(sample.tokens)}", highlight=False)
        text = prompt_text(todo[0].case, sample.tokens)
        if text is not None:
            console.print(f"which reads: {text!r}", highlight=False)
    return 1 if bad else 0
