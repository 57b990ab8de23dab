"""Every architecture of the installed transformers that builds a causal LM, from configs users
would bring: does ``kvbridge demo --model`` run it exactly, or refuse it in one line?

For each model type with a causal-LM class, several configs (:func:`variants`): the class's own
defaults as ``save_pretrained`` writes them (every field, infinite floats tagged), the model
type alone (every field left to its class default), real-size special token ids, and a GQA
ratio. Each goes through what the demo does with a user's config (:mod:`kvbridge.demo.configs`:
scaled down, built with random weights) and then, in this process, through the whole path a
request's cache takes: the real HF cache after a chunked prefill, checked against the CacheSpec
(:func:`kvbridge.demo.cache_io.check_cache`), sharded, planned between two layouts, executed,
reassembled, rebuilt as an HF cache, and decoded: the cache must be bitwise and the tokens
exactly what the undisturbed cache generates. ``kvbridge demo --model`` runs the same steps
across processes; what fails here fails there.

The outcome of each is :class:`Outcome`: EXACT, REFUSED (a :class:`~kvbridge.errors.SpecError`
or :class:`~kvbridge.errors.LayoutError` in one line: the demo says it before any process
starts) or BROKEN (anything else: a bug, reported with its one-line reason).

:func:`derived_variants` and :func:`group_variants` generate configs whose fields must move
together (issue 33): layer counts with the layer-type lists, patterns, layer ids, periods and
offsets that say which layer is what, and head/group ratios; ``tests/test_demo_derived.py``
checks that scaling keeps every such relation.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.demo import cache_io, forward
from kvbridge.demo.cachemap import cache_map
from kvbridge.demo.configs import case_from_raw
from kvbridge.demo.deployment import build_side, placement, with_window_pools
from kvbridge.demo.models import ModelCase, build_model, one_line, weigh
from kvbridge.errors import KVBridgeError, LayoutError, SpecError
from kvbridge.planner.plan import Pairing
from kvbridge.planner.reference import allocate, execute, fill
from kvbridge.planner.sidespec import SideOptions

SEED = 1234
PROMPT = tuple(b"kvbridge moves the cache: every byte, every layer, every layout.")
# Tried in order: the first the model's heads (and groups) shard over is the case's topology.
TOPOLOGIES = ("tp=2,page=16->tp=1,page=8,layout=hnd", "tp=1,page=16->tp=1,page=8,layout=hnd")
REAL_IDS = {"pad_token_id": 151643, "bos_token_id": 151644, "eos_token_id": 151645}


class Outcome(enum.Enum):
    EXACT = "exact"  # the whole path ran: bitwise cache, the same tokens
    ACCEPTED = "accepted"  # taken (and built, at Depth.BUILD); not run
    REFUSED = "refused"
    BROKEN = "broken"


class Depth(enum.Enum):
    """How far :func:`check` takes a config."""

    CONFIG = "config"  # scaled and its cache described: what the demo decides before it starts
    BUILD = "build"  # and the model built (on the meta device: no memory, no weights)
    RUN = "run"  # and the whole path, in this process


@dataclass(frozen=True)
class Result:
    model_type: str
    variant: str
    outcome: Outcome
    kinds: tuple[str, ...]  # the cache kinds the demo built (layer kinds, in order of first use)
    detail: str  # EXACT: the topology; otherwise the one-line reason


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in CONFIG_MAPPING_NAMES)


def saved_defaults(model_type: str) -> dict[str, Any]:
    """The class's default config as ``save_pretrained`` writes it (special floats tagged)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return dict(json.loads(CONFIG_MAPPING[model_type]().to_json_string()))


def variants(model_type: str) -> Iterator[tuple[str, dict[str, Any]]]:
    saved = saved_defaults(model_type)
    yield "defaults", saved
    yield "model_type only", {"model_type": model_type}
    ids = {k: v for k, v in REAL_IDS.items() if k in saved}
    if ids:
        yield "real-size token ids", {**saved, **ids}
    heads, kv = saved.get("num_attention_heads"), saved.get("num_key_value_heads")
    if isinstance(heads, int) and heads % 4 == 0 and kv != heads // 4:
        yield "GQA 4:1", {**saved, "num_key_value_heads": heads // 4}


def check(
    model_type: str, variant: str, config: dict[str, Any], depth: Depth = Depth.RUN
) -> Result:
    """One config as far as ``depth`` (see the module doc)."""
    kinds: tuple[str, ...] = ()
    try:
        where = f"{model_type} ({variant})"
        case = case_from_raw(config, where, model_type)
        cmap = cache_map(case)  # what the demo decides before it builds anything
        kinds = tuple(dict.fromkeys(layer.kind.value for layer in cmap.spec.layers))
        if depth is Depth.CONFIG:
            return Result(model_type, variant, Outcome.ACCEPTED, kinds, "taken")
        if depth is Depth.BUILD:
            weigh(case)
            return Result(model_type, variant, Outcome.ACCEPTED, kinds, "taken and built")
        tied = functools.partial(case_from_raw, config, where, model_type, tie_width=True)
        _, (kinds, topology) = forward.proven(case, tied, _run)
    except (SpecError, LayoutError) as e:
        return Result(model_type, variant, Outcome.REFUSED, kinds, one_line(e))
    except Exception as e:  # noqa: BLE001 - every other error is the finding: a bug
        return Result(
            model_type, variant, Outcome.BROKEN, kinds, f"{type(e).__name__}: {one_line(e)}"
        )
    return Result(model_type, variant, Outcome.EXACT, kinds, topology)


def _run(case: ModelCase) -> tuple[tuple[str, ...], str]:
    model = build_model(case, SEED)
    cmap = cache_map(case, model.config)
    return tuple(dict.fromkeys(layer.kind.value for layer in cmap.spec.layers)), round_trip(
        case, model, cmap
    )


def _sides(cmap: Any, tokens: int) -> tuple[str, SideOptions, SideOptions, Any, Any]:
    for topology in TOPOLOGIES:
        p, d = (SideOptions.parse(x) for x in topology.split("->"))
        p, d = with_window_pools(cmap.spec, p, d)
        try:
            sides = build_side(cmap.spec, p, tokens), build_side(cmap.spec, d, tokens)
        except (LayoutError, SpecError):
            continue
        return (topology, p, d, *sides)
    raise LayoutError(f"{cmap.spec.model}: no topology of {TOPOLOGIES} fits its heads")


def round_trip(case: ModelCase, model: Any, cmap: Any, topology: str | None = None) -> str:
    """The cache of a chunked prefill of :data:`PROMPT` through shard -> plan -> execute ->
    reassemble -> rebuild, at ``topology`` (else the first of :data:`TOPOLOGIES` that fits);
    KVBridgeError unless the rebuilt cache is bitwise the prefill's and decodes the same
    tokens. Returns the topology."""
    spec, n = cmap.spec, len(PROMPT)
    if topology is None:
        topology, po, do, ps, ds = _sides(cmap, n)
    else:
        po, do = with_window_pools(spec, *(SideOptions.parse(x) for x in topology.split("->")))
        ps, ds = build_side(spec, po, n), build_side(spec, do, n)
    src, dst = placement(spec, po, n, decode=False), placement(spec, do, n, decode=True)
    pools, received = allocate(ps), allocate(ds, fill_byte=0xA5)
    pairing = Pairing(ps, ds)
    first, cache = 0, None
    midway = _layerwise_reads(model, cmap, n)
    steps = forward.prefill_steps(model, PROMPT, 16 if case.chunked else n, before=midway.begin)
    for s, e, first, cache in _own(case, steps):
        midway.check(cache, e)
        if s == 0:
            cache_io.check_filled(cmap, cache)  # else the model's, a refusal
            try:
                cache_io.check_cache(cmap, cache, e)
            except SpecError as err:  # the demo's description is wrong: a bug, not a refusal
                raise KVBridgeError(f"the spec does not describe HF's cache: {err}") from None
        aux = (
            cache_io.pack_aux(first, n, spec.aux_bytes)
            if e == n
            else np.zeros(spec.aux_bytes, dtype=np.uint8)
        )
        fill(
            ps,
            src,
            cache_io.hf_to_logical(cmap, cache, n, e, aux),
            pools,
            decode=False,
            token_range=range(s, e),
            with_tail=e == n,
        )
        execute(pairing.plan(src, dst, s, e), pools, received)
    midway.remove()  # (the decode steps below are not the prefill's)
    got = cache_io.read_received(ds, dst, received)
    if got.problems:
        raise KVBridgeError(f"{case.name}: received: {got.problems[0]}")
    if (got.first_token, got.tokens) != (first, n):
        raise KVBridgeError(f"{case.name}: aux says {got.first_token}, {got.tokens}")
    rebuilt = cache_io.logical_to_hf(cmap, model.config, got)
    diff = cache_io.compare(cache_io.snapshot(cmap, cache), cache_io.snapshot(cmap, rebuilt))
    if diff is not None:
        raise KVBridgeError(f"{case.name}: the cache differs after the transfer: {diff}")
    try:
        want = forward.decode_steps(model, cache, first, n, 6)
    except Exception as e:  # noqa: BLE001 - the model's own decode, from its own cache
        raise _by_model(case, e) from None
    if forward.decode_steps(model, rebuilt, first, n, 6) != want:
        raise KVBridgeError(f"{case.name}: other tokens from the transferred cache")
    return topology


class _layerwise_reads:  # noqa: N801 - read as what it does
    """What the demo's prefill ranks read of each cache layer as soon as the decoder layer that
    writes it returns (:class:`kvbridge.demo.workers`' layer-wise sends), checked against the
    cache after the chunk: KVBridgeError where a layer is read before it is written, or where
    no decoder layer's return says it is (GPT-2's layers, found under another name than
    ``layers``, were never hooked: every layer-wise send failed)."""

    def __init__(self, model: Any, cmap: Any, tokens: int) -> None:
        from kvbridge.demo import hfcache

        self.cmap, self.n, self.stop = cmap, tokens, 0
        self.read: dict[int, Any] = {}
        indices = [hf.hf_index for hf in cmap.layers]
        self.hooks = hfcache.LayerHooks(model, indices, range(len(indices)), self._took)

    def remove(self) -> None:
        self.hooks.remove()

    def _took(self, _decoder_layer: int, layers: list[int]) -> None:
        for li in layers:
            self.read[li] = self._logical(li)

    def _logical(self, li: int) -> list[np.ndarray]:
        aux = np.zeros(self.cmap.spec.aux_bytes, dtype=np.uint8)
        got = cache_io.hf_to_logical(self.cmap, self.hooks.cache, self.n, self.stop, aux, [li])
        return [a.copy() for d in (got.token, got.state) for k, a in sorted(d.items())]

    def begin(self, start: int, stop: int, cache: Any) -> None:
        self.hooks.cache, self.stop, self.read = cache, stop, {}

    def check(self, cache: Any, stop: int) -> None:
        if not self.hooks.layerwise:  # the ranks read each layer after the forward, as here
            return
        for li in range(len(self.cmap.layers)):
            if li not in self.read:
                raise KVBridgeError(
                    f"cache layer {li}: no decoder layer's return was seen before it was done"
                )
            after = self._logical(li)
            if any(not np.array_equal(a, b) for a, b in zip(self.read[li], after, strict=True)):
                raise KVBridgeError(
                    f"cache layer {li}: read when its decoder layer returned, it is not yet what "
                    f"the forward leaves (tokens up to {stop})"
                )


def _own(case: ModelCase, steps: Iterator[Any]) -> Iterator[Any]:
    """The model's own forward steps: an error raised there is the model's (transformers does
    not run this config at the demo's size), a refusal, not a fault of the transfer."""
    try:
        yield from steps
    except SpecError:  # the demo's own refusal (a forward that takes no cache it knows)
        raise
    except Exception as e:  # noqa: BLE001 - whatever the model's forward raises
        raise _by_model(case, e) from None


def _by_model(case: ModelCase, e: Exception) -> SpecError:
    return SpecError(
        f"{case.name}: transformers' own forward fails on this config: "
        f"{type(e).__name__}: {one_line(e)}"
    )


def sweep_type(model_type: str, run: bool) -> list[Result]:
    """Every variant of ``model_type``: as far as the demo decides before it starts, or, with
    ``run``, the class defaults through the whole path and the other variants built (the
    whole path of a variant is its defaults' but for the fields it changes, which building
    exercises: special ids index the embedding, head counts shape the attention)."""
    try:
        configs = list(variants(model_type))
    except Exception as e:  # noqa: BLE001 - a config class that cannot build its defaults
        why = f"{model_type}: transformers' own default config does not build: {one_line(e)}"
        return [Result(model_type, "defaults", Outcome.REFUSED, (), why)]
    depth = {False: Depth.CONFIG, True: Depth.BUILD}[run]
    return [
        check(model_type, v, c, Depth.RUN if run and v == "defaults" else depth) for v, c in configs
    ]


def sweep(types: list[str] | None = None, *, run: bool = False, jobs: int = 1) -> Iterator[Result]:
    """:func:`sweep_type` of every type (each in a process of a pool of ``jobs``)."""
    todo = types or causal_lm_types()
    if jobs <= 1:
        for t in todo:
            yield from sweep_type(t, run)
        return
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(jobs, maxtasksperchild=8) as pool:
        for results in pool.imap(functools.partial(sweep_type, run=run), todo):
            yield from results


# ---- the record: docs/demo-sweep.json, and the tables rendered from it -----------------------

RECORD = Path(__file__).resolve().parents[3] / "docs" / "demo-sweep.json"


def to_json(results: list[Result], transformers: str) -> str:
    rows = [
        {
            "model_type": r.model_type,
            "variant": r.variant,
            "outcome": r.outcome.value,
            "kinds": list(r.kinds),
            "detail": r.detail,
        }
        for r in results
    ]
    return json.dumps({"transformers": transformers, "results": rows}, indent=1) + "\n"


def from_json(text: str) -> tuple[str, list[Result]]:
    raw = json.loads(text)
    return raw["transformers"], [
        Result(r["model_type"], r["variant"], Outcome(r["outcome"]), tuple(r["kinds"]), r["detail"])
        for r in raw["results"]
    ]


def families(results: list[Result]) -> str:
    """The README's coverage table: each set of cache kinds, and the architectures whose every
    config ran exact with it; the refused, counted."""
    by_type: dict[str, list[Result]] = {}
    for r in results:
        by_type.setdefault(r.model_type, []).append(r)
    groups: dict[tuple[str, ...], list[str]] = {}
    refused = []
    for mt, rs in sorted(by_type.items()):
        if rs[0].outcome is Outcome.EXACT and all(
            r.outcome in (Outcome.EXACT, Outcome.ACCEPTED) for r in rs
        ):
            groups.setdefault(rs[0].kinds, []).append(mt)
        else:
            refused.append(mt)
    lines = [
        "| cache kinds | architectures: the defaults exact, every other config taken |",
        "| --- | --- |",
    ]
    for kinds, types in sorted(groups.items(), key=lambda g: (-len(g[1]), g[0])):
        lines.append(f"| {' + '.join(kinds)} | {len(types)}: {', '.join(types)} |")
    lines.append(
        f"| refused or partly refused, in one line each | {len(refused)}: {', '.join(refused)} |"
    )
    return "\n".join(lines)


def markdown(results: list[Result], transformers: str) -> str:
    """docs/demo-sweep.md: every architecture and config, its outcome and why."""
    out = [
        "# The demo over every causal LM of the installed transformers",
        "",
        f"Generated by `python -m kvbridge.demo.sweep --run --write` with transformers "
        f"{transformers} (do not edit: a test compares it with `demo-sweep.json`). What each "
        "config goes through: `kvbridge.demo.sweep`'s docstring.",
        "",
        families(results),
        "",
        "| model type | config | outcome | cache kinds | topology, or why not |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        detail = r.detail.replace("|", "\\|")
        out.append(
            f"| {r.model_type} | {r.variant} | {r.outcome.value} | {' + '.join(r.kinds)} "
            f"| {detail} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    import transformers

    ap = argparse.ArgumentParser(prog="python -m kvbridge.demo.sweep", description=__doc__)
    ap.add_argument("--run", action="store_true", help="round trips too (else: configs only)")
    ap.add_argument("--types", nargs="+", help="these model types only")
    ap.add_argument("--jobs", type=int, default=2, help="processes at once")
    ap.add_argument(
        "--write",
        action="store_true",
        help="write docs/demo-sweep.{json,md} (with --types: those types' rows)",
    )
    args = ap.parse_args(argv)
    results = []
    for r in sweep(args.types, run=args.run, jobs=args.jobs):
        print(f"{r.model_type:28} {r.variant:22} {r.outcome.value:8} {r.detail}", flush=True)
        results.append(r)
    if args.write:
        if args.types and RECORD.exists():  # the other types' rows stay as recorded
            ran = set(args.types)
            kept = [r for r in from_json(RECORD.read_text())[1] if r.model_type not in ran]
            order = {t: i for i, t in enumerate(causal_lm_types())}
            results = sorted([*kept, *results], key=lambda r: order.get(r.model_type, -1))
        RECORD.write_text(to_json(results, transformers.__version__))
        RECORD.with_suffix(".md").write_text(markdown(results, transformers.__version__))
    return int(any(r.outcome is Outcome.BROKEN for r in results))


__all__ = [
    "Outcome",
    "Result",
    "causal_lm_types",
    "check",
    "round_trip",
    "sweep",
    "variants",
]

if __name__ == "__main__":
    raise SystemExit(main())
