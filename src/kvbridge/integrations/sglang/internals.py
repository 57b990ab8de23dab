"""Everything kvbridge touches of SGLang beyond its transfer backend's base classes
(``sglang.srt.disaggregation.base.conn``), in one place, for the one SGLang release it was
written against (:data:`SUPPORTED`): :func:`check_version` refuses any other at start-up.

- :func:`add_backend`: SGLang's ``--disaggregation-transfer-backend`` is a closed Enum and an
  if/elif (``disaggregation/utils.py``); kvbridge adds its name to the CLI choices and the Enum
  and wraps ``get_kv_class`` through SGLang's hook registry (no SGLang file is edited).
- :func:`add_request_hooks`: SGLang tells a backend's receiver a request's pages, not its
  length in tokens; kvbridge moves tokens (so that the two sides may page differently), and
  reads them where the decode scheduler makes the receiver, and the prompt where the prefill
  scheduler makes the sender (both sides' fingerprint of the request: SGLang keys a transfer
  by its room alone).
- :func:`place`, :func:`bootstrap_address`, :func:`deferred_release`: the parallel layout, the
  prefill server's bootstrap address, and whether SGLang holds a failed request's pages until
  its backend says no write can land.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import LayoutError
from kvbridge.integrations.sglang.pools import PoolArgs
from kvbridge.integrations.sglang.states import StateKind, states_of
from kvbridge.memory.location import HOST, Location, cuda
from kvbridge.model.modelconfig import load_config

log = logging.getLogger("kvbridge.sglang")

SUPPORTED = "0.5.23"
NAME = "kvbridge"  # the value of --disaggregation-transfer-backend


class UnsupportedSGLang(LayoutError):
    """The installed SGLang is not the release kvbridge's backend was written against."""


def version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def check_version() -> None:
    found = version()
    if found != SUPPORTED:
        raise UnsupportedSGLang(
            f"kvbridge's SGLang transfer backend supports SGLang {SUPPORTED}; this is SGLang "
            f"{found} (its backend classes and scheduler queues differ between releases)"
        )


def _add_member(cls: type[enum.Enum], name: str, value: str) -> None:
    """A member ``name = value`` added to an existing Enum (its value lookup included): the
    one step that uses Enum's internals, since SGLang's TransferBackend is closed."""
    if value in cls._value2member_map_:
        return
    member = object.__new__(cls)
    member._name_, member._value_ = name, value
    type.__setattr__(cls, name, member)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)


def add_backend(classes: Callable[[str], type | None]) -> None:
    """Make ``--disaggregation-transfer-backend kvbridge`` a choice whose classes are
    ``classes(class type)`` (SGLang's ``KVClassType`` values: manager, sender, receiver,
    bootstrap_server)."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    _add_member(TransferBackend, NAME.upper(), NAME)

    def get_kv_class(original: Callable[..., Any], backend: Any, class_type: Any) -> Any:
        if getattr(backend, "value", backend) != NAME or class_type is KVClassType.KVARGS:
            return original(backend, class_type)
        check_version()  # refused where the server starts, naming both releases
        return classes(class_type.value)

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND
    )


def add_request_hooks(
    decode: Callable[[Any, Sequence[int]], None], prefill: Callable[[Any, Sequence[int]], None]
) -> None:
    """As a scheduler makes a request's receiver or sender, the tokens whose KV it moves:
    ``decode(receiver, ids)`` (the prompt; the prompt and the output of a request SGLang
    re-bootstraps), ``prefill(sender, ids)`` (the prompt)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def made(result: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        receiver = getattr(result, "kv_receiver", None)
        if receiver is not None:
            # As SGLang's decode queue counts a prefill's tokens: a request it re-bootstraps
            # has its output recomputed too.
            again = getattr(req, "pd_rebootstrap_in_progress", False)
            decode(receiver, [*req.origin_input_ids, *(req.output_ids if again else ())])
        return result

    def sending(result: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        sender = getattr(req, "disagg_kv_sender", None)
        if result and sender is not None:
            prefill(sender, req.origin_input_ids)
        return result

    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._create_receiver_and_enqueue",
        made,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.create_sender",
        sending,
        HookType.AFTER,
    )


# What the scheduler's pools were when it built its KV manager: its sliding window (SGLang's,
# exclusive: the config's inclusive window less one for gpt-oss, Mellum, Gemma 4 ...; Llama 4's
# attention_chunk_size), which SGLang's window page lists are cut by on both sides, and the
# global layer id of each layer of its sliding-window sub-pool, in the sub-pool's order (its
# KVArgs give the buffers without them).
_WINDOW: list[int | None] = [None]
_SWA_LAYERS: list[tuple[int, ...]] = [()]


def note_pools(window: Any, pool: Any) -> None:
    """Note a scheduler's sliding window and its KV pool's sliding-window layers
    (``SWAKVPool.layers_mapping``: global layer id -> (index in its sub-pool, whether the
    sub-pool is the sliding-window one))."""
    _WINDOW[0] = int(window) if window else None
    mapping = getattr(pool, "layers_mapping", None)
    swa: list[tuple[int, int]] = []
    if isinstance(mapping, dict):
        swa = sorted((int(at), int(lid)) for lid, (at, sliding) in mapping.items() if sliding)
    _SWA_LAYERS[0] = tuple(lid for _, lid in swa)


def add_window_hook() -> None:
    """Before a prefill or decode queue builds its KV manager, note its scheduler's sliding
    window and its pool's sliding-window layers (:func:`note_pools`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any) -> Any:
        window = getattr(getattr(queue, "scheduler", None), "sliding_window_size", None)
        note_pools(window, getattr(queue, "token_to_kv_pool", None))
        return original(queue, *args, **kwargs)

    for target in (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
    ):
        HookRegistry.register(target, around, HookType.AROUND)


def sliding_window() -> int | None:
    return _WINDOW[0]


def sliding_layers() -> tuple[int, ...]:
    return _SWA_LAYERS[0]


def model_config(model_path: str) -> dict[str, object]:
    """The model's ``config.json`` as SGLang reads it: a local directory's, or a hub id's from
    the local Hugging Face cache (where SGLang found it)."""
    if os.path.isdir(model_path) or os.path.isfile(model_path):
        return load_config(model_path)
    from transformers.utils import cached_file

    found = cached_file(model_path, "config.json")
    if found is None:
        raise LayoutError(f"no config.json for model {model_path!r} in the Hugging Face cache")
    return load_config(found)


@dataclass(frozen=True)
class Place:
    """Where a scheduler process sits in its server, and the server's own address."""

    tp: int
    tp_rank: int
    pp: int
    dp: int  # attention data-parallel groups
    host: str
    port: int  # the server's HTTP port (names a decode engine)
    dtype: str  # the model's dtype option, as given


def place(server_args: Any) -> Place:
    from sglang.srt.runtime_context import get_model, get_parallel, get_serving

    parallel = get_parallel()
    serving = get_serving()
    return Place(
        tp=int(parallel.attn_tp_size),
        tp_rank=int(parallel.attn_tp_rank),
        pp=int(parallel.pp_size),
        dp=int(parallel.attn_dp_size),
        host=str(serving.host),
        port=int(serving.port),
        dtype=str(getattr(get_model(), "dtype", getattr(server_args, "dtype", "auto"))),
    )


def aux_room(aux_ptrs: Sequence[int], aux_item_lens: Sequence[int], slot: int) -> int:
    """The bootstrap room a request slot's SGLang metadata names: its metadata buffers list the
    room last, an int64 first in each slot (its decode waits, without a deadline, until that
    room is non-zero, and aborts a request whose room differs)."""
    return int(ctypes.c_int64.from_address(aux_ptrs[-1] + slot * aux_item_lens[-1]).value)


def total_kv_heads(server_args: Any) -> int:
    """The model's KV heads, as SGLang counts them (its decode ``KVArgs`` leaves them unset)."""
    from sglang.srt.configs.model_config import ModelConfig

    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())


def bootstrap_address() -> str:
    """host:port of this (prefill) server's bootstrap service."""
    from sglang.srt.runtime_context import get_disagg, get_serving

    return f"{get_serving().host}:{get_disagg().disaggregation_bootstrap_port}"


def deferred_release() -> tuple[bool, float]:
    """Whether SGLang's decode holds a failed request's pages until its backend says they may
    be reused, and for at most how many seconds."""
    from sglang.srt.environ import envs

    return (
        bool(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()),
        float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()),
    )


def pool_args(args: Any, place: Place, mla: bool, server_args: Any) -> PoolArgs:
    """The part of SGLang's ``KVArgs`` kvbridge reads (its decode leaves the heads unset: they
    come from the model's config, as SGLang shards them)."""
    # A hybrid pool over an MLA pool (Kimi Linear) is no MLATokenToKVPool, so SGLang passes
    # its backend is_mla_backend=False; its KVArgs say so instead (and carry MHA head counts
    # that mean nothing for a latent).
    mla = mla or bool(getattr(args, "is_hybrid_mla_backend", False))
    total = 0 if mla else getattr(args, "total_kv_head_num", None)
    if total is None:
        total = total_kv_heads(server_args)
    heads = getattr(args, "kv_head_num", None) or max(1, total // place.tp)
    states = states_of(args)
    kinds = {s.kind for s in states}
    # Hybrid pools are described from the model's config; DSA's indexer needs none.
    model = model_config(str(server_args.model_path)) if kinds - {StateKind.DSA.value} else None
    dtype = f"{args.kv_cache_dtype_str}/{place.dtype}"
    if model is not None and StateKind.MAMBA.value in kinds:
        # State widths come from the slots' bytes; their names (bf16 and fp16 are one width)
        # from what SGLang reads them from, so two servers that differ are refused at pairing.
        conv = os.environ.get("SGLANG_MAMBA_CONV_DTYPE") or "bfloat16"
        ssm = os.environ.get("SGLANG_MAMBA_SSM_DTYPE") or model.get("mamba_ssm_dtype", "float32")
        dtype += f" mamba conv={conv} ssm={ssm}"
    return PoolArgs(
        kv_ptrs=tuple(args.kv_data_ptrs),
        kv_lens=tuple(args.kv_data_lens),
        kv_item_lens=tuple(args.kv_item_lens),
        page_size=int(args.page_size),
        kv_heads=0 if mla else int(heads),
        total_kv_heads=int(total),
        aux_ptrs=tuple(args.aux_data_ptrs),
        aux_lens=tuple(args.aux_data_lens),
        aux_item_lens=tuple(args.aux_item_lens),
        dtype=dtype,
        mla=mla,
        tp=place.tp,
        tp_rank=place.tp_rank,
        states=states,
        kv_layer_ids=tuple(int(i) for i in getattr(args, "kv_layer_ids", None) or ()),
        model=model,
        window=sliding_window(),
        swa_layer_ids=sliding_layers() if StateKind.SWA.value in kinds else (),
        location=kv_location(getattr(server_args, "device", None), getattr(args, "gpu_id", 0)),
    )


def kv_location(device: str | None, gpu_id: int) -> Location:
    """Where SGLang keeps the pools its ``KVArgs`` point into: on the server's device (CUDA:
    the scheduler's GPU, ``KVArgs.gpu_id``), or the host for its CPU build."""
    if device == "cpu":
        return HOST
    if device in (None, "cuda"):  # None: SGLang's default, resolved to cuda on a GPU server
        return cuda(int(gpu_id))
    raise UnsupportedSGLang(
        f"kvbridge moves host and CUDA memory; this SGLang server keeps its KV on {device!r}"
    )
