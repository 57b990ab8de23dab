"""The ``kvbridge`` command: plan, bench (:mod:`kvbridge.cli.bench`), demo, bootstrap, proxy,
chaos.

A bad option value, or any kvbridge error, ends the command with one line on stderr,
``kvbridge: error: --prefill: page must be in [1, 65536] (tokens per page), got 0``, and exit
status 2 (as argparse does). Option values are checked when parsed, by the types of
:mod:`kvbridge.cli.options`, before anything is computed from them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from kvbridge.cli import options as opt
from kvbridge.cli.bench import bench
from kvbridge.cli.plan_report import report
from kvbridge.config import check_host, check_token
from kvbridge.deploy import shield
from kvbridge.errors import KVBridgeError
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing
from kvbridge.planner.sidespec import LIMITS, SideOptions

err = Console(stderr=True)
SIDE = opt.Checked("KEY=VALUE,...", SideOptions.parse)
URL = opt.Checked("URL", opt.server_url)
BOOTSTRAP = opt.Checked("HOST:PORT", opt.bootstrap_address)


def _chaos(name: str) -> opt.Bounded:
    def bounds() -> tuple[int, int]:
        from kvbridge.chaos.soak import BOUNDS

        return BOUNDS[name]

    return opt.Bounded(bounds)


def _fail(message: str) -> NoReturn:
    # click.echo, not rich: rich wraps a long line to the terminal's width.
    click.echo(f"kvbridge: error: {' '.join(message.split())}", err=True)
    sys.exit(2)


@contextmanager
def _blame(option: str) -> Iterator[None]:
    """Name ``option`` in a kvbridge error raised while its (parsed) value is used with the
    others', e.g. a side's page size against --tokens."""
    try:
        yield
    except KVBridgeError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


class _Group(click.Group):
    """Ends any usage error or kvbridge error with one line on stderr and exit status 2."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # a bare `kvbridge` (click >= 8.2)
                e.show()
                sys.exit(e.exit_code)
            _fail(opt.one_line(e))
        except KVBridgeError as e:  # raised while running: the message names what was wrong
            _fail(str(e))
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except BrokenPipeError:  # `kvbridge plan | head`: quiet, as click's standalone mode is
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Group)
@click.version_option(package_name="kvbridge")
def main() -> None:
    """Move the KV cache of LLM requests from prefill ranks to decode ranks."""


def run() -> None:
    """The ``kvbridge`` command as a process of its own: its console script, ``python -m
    kvbridge`` (a caller of :func:`main` in its own process keeps its fork server whole)."""
    shield.command_process()
    main(prog_name="kvbridge")


@main.command()
@click.option(
    "--model",
    type=opt.MODEL,
    required=True,
    help="Preset name (see `kvbridge models`) or config.json path.",
)
@click.option(
    "--prefill",
    "po",
    type=SIDE,
    default="tp=1",
    show_default=True,
    help="Prefill side: tp=,pp=,page=,layout=nhd|hnd,pages=,swa=,conv=sd|ds, "
    "dp= (attention DP groups), cp= (context-parallel groups), dcp= (DCP ranks "
    "within TP), tokens=contiguous|zigzag|interleaved, interleave= (bounds: "
    + ", ".join(f"{k} {lo}..{hi}" for k, (lo, hi, _) in LIMITS.items())
    + ").",
)
@click.option(
    "--decode", "do", type=SIDE, default="tp=1", show_default=True, help="Decode side, same keys."
)
@click.option(
    "--tokens", type=opt.TOKENS, default=4096, show_default=True, help="Tokens in the request."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plan(model: str, po: SideOptions, do: SideOptions, tokens: int, as_json: bool) -> None:
    """Print which prefill rank sends what to which decode rank."""
    from kvbridge.model.hf import load_spec

    spec = load_spec(model)
    with _blame("--prefill"):
        prefill = po.side(spec, tokens)
    with _blame("--decode"):
        decode = do.side(spec, tokens)
    pairing = Pairing(prefill, decode)
    src = Placement.simple(tokens, np.arange(po.request_pages(tokens)))
    dst = Placement.simple(tokens, np.arange(do.request_pages(tokens)))
    result = pairing.plan(src, dst)
    report(spec, po, do, tokens, pairing, result, as_json)


@main.command("models")
def models() -> None:
    """List the model presets."""
    from kvbridge.model.hf import load_spec
    from kvbridge.model.modelconfig import list_presets

    for name in list_presets():
        spec = load_spec(name)
        kinds: dict[str, int] = {}
        for layer in spec.layers:
            kinds[layer.kind.value] = kinds.get(layer.kind.value, 0) + 1
        click.echo(
            f"{name:24s} {spec.num_layers:3d} layers  "
            + " ".join(f"{k}={v}" for k, v in kinds.items())
        )


@main.command("bootstrap")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    callback=opt.checked(check_host),
    help="Address to listen on (loopback unless you need other hosts).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8998,
    show_default=True,
    help="Port; 0 picks a free one.",
)
@click.option(
    "--token",
    default=None,
    callback=opt.checked(check_token),
    help="Require each request to prove it knows TOKEN (never sent).",
)
def bootstrap_cmd(host: str, port: int, token: str | None) -> None:
    """Run the rendezvous service where prefill ranks register and decode ranks look them up."""
    from kvbridge.bootstrap import serve_forever

    def listening(address: str) -> None:
        guard = " (token required)" if token is not None else ""
        click.echo(f"kvbridge bootstrap listening on http://{address}{guard}")

    with _blame("--host/--port"):  # the address is taken, or not this host's
        serve_forever(host, port, token, on_listening=listening)


@main.command("proxy")
@click.option(
    "--prefill",
    "prefill",
    type=URL,
    multiple=True,
    required=True,
    help="A vLLM prefill server's URL (kv_producer); repeat for several.",
)
@click.option(
    "--decode",
    "decode",
    type=URL,
    multiple=True,
    required=True,
    help="A vLLM decode server's URL (kv_consumer); repeat for several.",
)
@click.option("--host", default="127.0.0.1", show_default=True, callback=opt.checked(check_host))
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--timeout",
    type=float,
    callback=opt.checked(opt.proxy_timeout),
    default=300.0,
    show_default=True,
    help="Seconds an upstream call may take.",
)
@click.option(
    "--prefill-bootstrap",
    "bootstrap",
    type=BOOTSTRAP,
    multiple=True,
    help="The kvbridge bootstrap service (host:port) of each --prefill server, in "
    "order: then both legs of a request go at once and the prefill streams "
    "each layer as computed.",
)
def proxy_cmd(
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    host: str,
    port: int,
    timeout: float,
    bootstrap: tuple[str, ...],
) -> None:
    """One OpenAI-compatible endpoint in front of vLLM prefill and decode servers that use
    kvbridge's connector (/v1/completions, /v1/chat/completions)."""
    import logging

    from kvbridge.integrations.vllm.proxy import serve

    if bootstrap and len(bootstrap) != len(prefill):
        raise click.BadParameter(
            f"one per --prefill, in order: got {len(bootstrap)} for {len(prefill)}",
            param_hint="--prefill-bootstrap",
        )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    click.echo(
        f"kvbridge proxy on http://{host}:{port}: prefill {', '.join(prefill)}; "
        f"decode {', '.join(decode)}"
    )
    with _blame("--host/--port"):  # the address is taken, or not this host's
        serve(prefill, decode, host, port, timeout, bootstrap)


@main.command("demo")
@click.option(
    "--model",
    type=opt.Checked("MODEL", opt.demo_model),
    default=None,
    help="One demo model, or a Hugging Face config.json (or a directory holding "
    "one) of any architecture the demo knows (default: the built-in models).",
)
@click.option(
    "--full-size",
    is_flag=True,
    help="With a config file: keep its real dimensions instead of a small "
    "model of the same structure; with a model directory holding weights: serve "
    "those weights, with its tokenizer.json.",
)
@click.option(
    "--topology",
    type=opt.Checked("TOPOLOGY", opt.topology),
    default=None,
    help="tp4-tp1, tp1-tp4, tp2-tp3, pp2-pp1, page64-16, nhd-hnd... or "
    "PREFILL->DECODE side options (default: each model's own).",
)
@click.option(
    "--transport",
    type=click.Choice(["shm", "tcp", "cudaipc", "nixl", "mooncake"]),
    default=None,
    help="Run every case on this transport (default: the matrix mixes shm and tcp; "
    "with --device cuda, cudaipc and tcp).",
)
@click.option(
    "--prompt",
    type=opt.Checked("TEXT", opt.prompt),
    default=None,
    help=f"Prompt text (tokens are its UTF-8 bytes, at most {opt.MAX_PROMPT}).",
)
@click.option(
    "--new-tokens",
    type=click.IntRange(2, opt.MAX_NEW_TOKENS),
    default=16,
    show_default=True,
    help="Tokens to generate (the first is sampled by prefill).",
)
@click.option("--device", default="cpu", show_default=True, help="cuda[:I]: see docs/gpu.md.")
@click.option(
    "--timeout",
    type=float,
    callback=opt.checked(opt.demo_timeout),
    default=60.0,
    show_default=True,
    help="Seconds a case's processes may take to answer (the reference run's first answer "
    "a minute more): raise it for large --full-size models on a busy host.",
)
def demo(
    model: str | None,
    full_size: bool,
    topology: str | None,
    transport: str | None,
    prompt: str | None,
    new_tokens: int,
    device: str,
    timeout: float,
) -> None:
    """Disaggregated generation on real HF architectures, checked token-exact and
    cache-bitwise against the same model run undisturbed. Exits 1 on any mismatch.
    ``--device cuda``: every process runs its model and keeps its pools on the GPU, and
    kvbridge moves device memory (docs/gpu.md)."""
    from importlib.util import find_spec

    from kvbridge.bench.device import check_device_option

    with _blame("--device"):
        where = check_device_option(device)
    if where is not None and transport == "shm":
        _fail(
            f"--transport shm moves host memory only: on --device {device} use "
            f"cudaipc, tcp, nixl or mooncake"
        )
    if where is None and transport == "cudaipc":
        _fail("--transport cudaipc moves CUDA device memory: add --device cuda")

    missing = [m for m in ("torch", "transformers") if find_spec(m) is None]
    if missing:  # only the worker processes import them
        _fail(f"the demo needs {' and '.join(missing)}: pip install -e '.[demo]'")
    from kvbridge.demo.matrix import cells, run_demo
    from kvbridge.demo.run import DEFAULT_PROMPT

    opt.environment()
    with _blame("--model/--topology"):  # a config the demo cannot take, or a misfit layout
        cells(model, topology, transport, full_size, on_device=where is not None)
    sys.exit(
        run_demo(
            model,
            topology,
            transport,
            prompt or DEFAULT_PROMPT,
            new_tokens,
            full_size=full_size,
            device="cpu" if where is None else f"cuda:{where.device}",
            timeout=timeout,
        )
    )


@main.command("chaos")
@click.option("--requests", type=_chaos("requests"), default=300, show_default=True)
@click.option(
    "--round",
    "round_",
    type=_chaos("round"),
    default=10,
    show_default=True,
    help="Requests in flight together; one fault is drawn per round.",
)
@click.option("--seed", type=_chaos("seed"), default=0, show_default=True)
@click.option(
    "--transport", type=click.Choice(["shm", "tcp", "mooncake"]), default="shm", show_default=True
)
@click.option(
    "--hosts",
    is_flag=True,
    help="The bootstrap service, the prefill ranks and the decode ranks each on a host of "
    "their own (network namespaces, as root), with partitions, loss and delay among the faults.",
)
@click.option(
    "--faults",
    default="all",
    show_default=True,
    help="Comma-separated fault names to draw from (an unknown one lists them).",
)
def chaos(requests: int, round_: int, seed: int, transport: str, hosts: bool, faults: str) -> None:
    """Soak a real multi-process deployment with faults drawn at random (kill -9, SIGSTOP,
    dropped/duplicated/reordered notices, forged messages, slow peers, the bootstrap service
    restarted; with --hosts, partitions, loss and delay), integrity on. Prints what happened
    and exits 1 on any violation: a request that never ended, a false success, wrong bytes, a
    byte landed after release, rooms/threads/segments left, resources still rising."""
    from kvbridge.chaos.soak import ChaosConfig, Fault, run_chaos

    opt.environment()
    shield.without_demo()  # its ranks are kvbridge's alone
    if hosts:
        from kvbridge.deploy.netns import unavailable

        why = unavailable()
        if why is not None:
            _fail(f"--hosts: {why}")
    if faults == "all":
        kinds: tuple[Fault, ...] = ()  # every kind that applies
    else:
        try:
            kinds = tuple(Fault[f.strip().upper()] for f in faults.split(",") if f.strip())
        except KeyError as e:
            raise click.BadParameter(
                f"unknown fault {e.args[0].lower()!r}; known: "
                f"{', '.join(f.name.lower() for f in Fault)}",
                param_hint="--faults",
            ) from None
        if not kinds:
            raise click.BadParameter("name at least one fault", param_hint="--faults")
    with _blame("--transport/--hosts/--faults"):
        cfg = ChaosConfig(
            requests=requests,
            round=round_,
            seed=seed,
            transport=transport,
            faults=kinds,
            hosts=hosts,
        )

    def progress(done: int, rep: object) -> None:
        err.print(f"{done}/{requests} requests", highlight=False)

    rep = run_chaos(cfg, progress)
    table = Table(
        title="kvbridge chaos",
        show_header=False,
        caption='rows "… ranks …" count each request once per rank',
    )
    table.add_column("")
    table.add_column("", justify="right")
    for k, v in rep.rows():
        table.add_row(k, v)
    Console().print(table)
    for v in rep.violations[:20]:
        err.print(f"[red]violation:[/red] {v}", highlight=False)
    sys.exit(0 if rep.ok else 1)


main.add_command(bench)
