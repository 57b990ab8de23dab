"""``kvbridge bench``: its group and subcommands (plan, transfer, layerwise), registered on the
``kvbridge`` command by :mod:`kvbridge.cli`, which ends every error in one line."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

from kvbridge.cli import options as opt
from kvbridge.deploy import shield
from kvbridge.planner.sidespec import LIMITS
from kvbridge.transports import HOST_NAMES as TRANSPORTS

err = Console(stderr=True)
CROSS_PROCESS = tuple(t for t in TRANSPORTS if t != "inproc")  # bench ranks are processes


def _rounds(lo: int) -> opt.Bounded:
    def bounds() -> tuple[int, int]:
        from kvbridge.bench.transfer import MAX_ROUNDS

        return lo, MAX_ROUNDS

    return opt.Bounded(bounds)


# options every bench command has
_WARMUP = click.option(
    "--warmup", type=_rounds(0), default=1, show_default=True, help="Untimed rounds first."
)
_SHUFFLED = click.option(
    "--shuffled",
    is_flag=True,
    help="Shuffled page ids instead of contiguous ones (a busy server's scattered pages).",
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
_CROSS_PROCESS = click.option(
    "--transports",
    type=opt.Checked("NAME,...", opt.names(CROSS_PROCESS)),
    default="shm,tcp",
    show_default=True,
    help="Comma-separated.",
)


_F = TypeVar("_F", bound=Callable[..., Any])


def _token_list(default: str, what: str) -> Callable[[_F], _F]:
    return click.option(
        "--tokens", type=opt.TOKEN_LIST, default=default, show_default=True, help=what
    )


def _page(default: int) -> Callable[[_F], _F]:
    return click.option(
        "--page",
        type=click.IntRange(*LIMITS["page"][:2]),
        default=default,
        show_default=True,
        help="Tokens per page.",
    )


def _timed_rounds(default: int) -> Callable[[_F], _F]:
    return click.option(
        "--repeat",
        type=_rounds(1),
        default=default,
        show_default=True,
        help="Timed rounds (new rooms).",
    )


@click.group(invoke_without_command=True)
@click.option(
    "--tokens",
    type=opt.TOKEN_LIST,
    default="4096",
    show_default=True,
    help="Comma-separated request lengths (32768 moves only the first layers).",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=None,
    help="Move the model's first N layers [default: as `bench transfer`].",
)
@click.option(
    "--transports",
    type=opt.Checked("NAME,...", opt.names(TRANSPORTS)),
    default=",".join(TRANSPORTS),
    show_default=True,
    help="Comma-separated.",
)
@click.option("--repeat", type=_rounds(1), default=3, show_default=True, help="Timed rounds.")
@_WARMUP
@click.option("--model", type=opt.MODEL, default="qwen3-32b", show_default=True)
@click.option(
    "--max-descriptors",
    type=click.IntRange(min=0),
    default=100_000,
    show_default=True,
    help="Skip cases with more descriptors on slow engines (mooncake).",
)
@_JSON
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="cuda[:I]: the transports between device pools beside the device's own copy limits "
    "(refused where CUDA is not usable).",
)
@click.option(
    "--plot",
    "plot_path",
    type=opt.Checked("PNG", opt.png_path),
    default=None,
    help="Draw the bars into this PNG.",
)
@click.pass_context
def bench(
    ctx: click.Context,
    tokens: tuple[int, ...],
    layers: int | None,
    transports: tuple[str, ...],
    repeat: int,
    warmup: int,
    model: str,
    max_descriptors: int,
    as_json: bool,
    device: str,
    plot_path: str | None,
) -> None:
    """Benchmarks: figures are ratios measured in one run. Without a subcommand: memcpy,
    every transport and the raw engines on the same requests, in one table."""
    opt.environment()
    shield.without_demo()  # its ranks are kvbridge's alone
    from kvbridge.bench import device as on_device
    from kvbridge.errors import KVBridgeError

    try:
        where = on_device.check_device_option(device)
    except KVBridgeError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    if where is not None:
        if ctx.invoked_subcommand is not None:
            raise click.UsageError(
                f"--device {device} measures device pools on its own; "
                f"'bench {ctx.invoked_subcommand}' runs on host memory"
            )
        rows = on_device.limits_and_transports(on_device.DEVICE_TRANSPORTS, where)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        else:
            on_device.print_bench(rows)
        return
    if ctx.invoked_subcommand is not None:
        return
    from kvbridge.bench import suite

    if plot_path is not None:
        suite.require_matplotlib()
    rows = suite.run_suite(
        model=model,
        tokens=tokens,
        layers=layers,
        transports=transports,
        repeat=repeat,
        warmup=warmup,
        max_descriptors=max_descriptors,
        quiet=as_json,
    )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    if plot_path is not None:
        suite.plot(rows, plot_path)
        err.print(f"plot: {plot_path}", highlight=False)


@bench.command("plan")
@click.option("--tokens", type=opt.TOKENS, default=32768, show_default=True)
@click.option("--model", type=opt.MODEL, default="qwen3-32b", show_default=True)
@click.option("--repeat", type=_rounds(1), default=20, show_default=True)
@_page(64)
def bench_plan(tokens: int, model: str, repeat: int, page: int) -> None:
    """Time to plan a request, P4 -> D1, NHD/HND, contiguous/shuffled pages."""
    from kvbridge.bench.planning import run_plan_bench

    run_plan_bench(model=model, tokens=tokens, repeat=repeat, console=Console(), page=page)


@bench.command("transfer")
@_token_list("4096,32768", "Comma-separated request lengths.")
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=None,
    help="Move the model's first N layers [default: all if one side's pools fit "
    "1.5 GiB, else the largest power of two that does].",
)
@_CROSS_PROCESS
@_timed_rounds(5)
@_WARMUP
@click.option("--model", type=opt.MODEL, default="qwen3-32b", show_default=True)
@_page(64)
@_SHUFFLED
@_JSON
def bench_transfer(
    tokens: tuple[int, ...],
    layers: int | None,
    transports: tuple[str, ...],
    repeat: int,
    warmup: int,
    model: str,
    page: int,
    shuffled: bool,
    as_json: bool,
) -> None:
    """A request between real processes over each transport, next to memcpy."""
    from kvbridge.bench.transfer import run_transfer_bench

    rows = run_transfer_bench(
        model=model,
        tokens=tokens,
        layers=layers,
        transports=transports,
        repeat=repeat,
        warmup=warmup,
        page=page,
        shuffled=shuffled,
        as_json=as_json,
    )
    if as_json:
        click.echo(json.dumps(rows, indent=2))


@bench.command("latency")
@_token_list("64,512,2048", "Comma-separated prompt lengths.")
@_CROSS_PROCESS
@click.option("--model", type=opt.MODEL, default="llama-3.1-8b", show_default=True)
@_page(16)
@_SHUFFLED
@_timed_rounds(20)
@click.option(
    "--warmup", type=_rounds(0), default=3, show_default=True, help="Untimed rounds first."
)
@click.option(
    "--busy",
    is_flag=True,
    help="Each rank's engine thread polls its request in a Python loop, as a serving "
    "engine's scheduler does, instead of blocking: kvbridge's threads then wait for the "
    "interpreter after every blocking call.",
)
@_JSON
def bench_latency(
    tokens: tuple[int, ...],
    transports: tuple[str, ...],
    model: str,
    page: int,
    shuffled: bool,
    repeat: int,
    warmup: int,
    busy: bool,
    as_json: bool,
) -> None:
    """One request at a time: where its time goes, phase by phase, on both sides."""
    from kvbridge.bench.latency import run_latency_bench

    rows = run_latency_bench(
        model=model,
        tokens=tokens,
        transports=transports,
        repeat=repeat,
        warmup=warmup,
        page=page,
        shuffled=shuffled,
        as_json=as_json,
        busy=busy,
    )
    if as_json:
        click.echo(json.dumps(rows, indent=2))


@bench.command("layerwise")
@click.option("--model", type=opt.MODEL, default="llama-3.1-8b", show_default=True)
@click.option("--tokens", type=opt.TOKENS, default=2048, show_default=True)
@click.option(
    "--layer-ms",
    type=click.FloatRange(0, 10_000),
    default=4.0,
    show_default=True,
    help="Simulated compute of one layer of the prefill forward (a sleep).",
)
@_CROSS_PROCESS
@click.option("--repeat", type=_rounds(1), default=5, show_default=True, help="Timed rounds.")
@_WARMUP
@_JSON
def bench_layerwise(
    model: str,
    tokens: int,
    layer_ms: float,
    transports: tuple[str, ...],
    repeat: int,
    warmup: int,
    as_json: bool,
) -> None:
    """Layer-wise sends against bulk: the transfer left after the (simulated) forward."""
    from kvbridge.bench.layerwise import run_layerwise_bench

    rows = run_layerwise_bench(
        model=model,
        tokens=tokens,
        layer_ms=layer_ms,
        transports=transports,
        repeat=repeat,
        warmup=warmup,
        as_json=as_json,
    )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
