"""kvbridge's TEST-ONLY patches of SGLang modules for its CPU path: the kernels SGLang 0.5.23
reaches for hybrid models there that are neither in ``sgl_kernel`` nor pure torch, one read of
its CPU attention that misses the sliding-window pool, and the MLA dispatch its CPU attention
lacks.

- ``sglang.srt.layers.attention.mamba.mamba`` (MambaMixer2, every Mamba2 hybrid):
  ``causal_conv1d_fn`` and ``causal_conv1d_update``, and their ``_triton`` twins (which
  Nemotron-H asks for), are bound only on CUDA, NPU and XPU (a NameError on CPU), and
  ``mamba_chunk_scan_combined`` and ``selective_state_update`` are Triton kernels (no CPU
  driver). All six are set to ``_torch_ops``'s.
- ``sglang.kernels.ops.attention.fla.fused_norm_gate``: ``FusedRMSNormGated`` (GDN's output
  norm) calls the Triton ``rms_norm_gated`` unless the CPU has AMX (then the real CPU kernel).
- ``sglang.srt.models.qwen2_moe`` (the MoE block of Qwen3-Next): the shared expert's sigmoid
  gate goes to the Triton ``fused_gate_sigmoid_mul(_add)`` unless the gate runs on AMX; the
  names it imported are set to ``_torch_ops``'s.
- ``sglang.srt.layers.attention.torch_native_backend`` (``TorchNativeAttnBackend``, the CPU
  attention), for a model SGLang gives its hybrid sliding-window pool (``SWAKVPool``: gpt-oss,
  Mellum, Llama 4): a sliding layer's K and V are *written* at the window sub-pool's slots (the
  full-pool slots translated by ``translate_loc_from_full_to_swa``) but *read* through the
  full-pool slots of ``req_to_token``, so a sliding layer attends to other tokens' KV once the
  two allocators part (and indexes past the window pool, an IndexError, once a full-pool slot
  exceeds its size). Patched: for a sliding layer, ``forward_extend`` and ``forward_decode`` read
  ``req_to_token`` through the same translation. Tokens the window pool has freed translate to
  its padding slot, and the window mask SGLang builds there hides them. Full-attention layers,
  and every model without that pool, take SGLang's code unchanged.
- ``sglang.srt.models.deepseek_common.attention_backend_handler`` (how a DeepSeek-class MLA
  layer computes attention, per backend): ``torch_native`` has no entry, so it takes Triton's,
  which runs a fresh prefill as plain MHA over the latent cache, read as MHA keys of the wrong
  width (a RuntimeError in the first prefill). Patched: ``torch_native`` is registered for
  absorbed MLA (``AttnForwardMethod.MLA``) in every forward, whose queries, keys (the latent
  rows) and values (their first ``kv_lora_rank`` dims) ``torch_native`` attends over as it
  does for any layer whose key and value widths differ.

How they get in: SGLang imports ``sgl_kernel`` in every process that builds a model (its CPU path
does so at start-up, and GDN's backend, built for any hybrid model, imports ``sgl_kernel.mamba``),
and this stand-in package's ``__init__`` calls :func:`install`. That patches a target module
already imported and hooks the import of one that is not, so the order does not matter. Only
under SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``), the one place these stand-ins are meant
for. Nothing outside tests/sglang_standins/ is involved (no sitecustomize, no entry point).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from sgl_kernel import _torch_ops

logger = logging.getLogger(__name__)


def _patch_mamba2(module: types.ModuleType) -> None:
    # NemotronH asks MambaMixer2 for the "_triton" conv variants (use_triton_causal_conv=True,
    # models/nemotron_h.py _forward_mamba); other Mamba2 models get the plain ones. Same
    # contract, same pools: both names get the one stand-in.
    for name in ("causal_conv1d_fn", "causal_conv1d_fn_triton"):
        setattr(module, name, _torch_ops.causal_conv1d_fn)
    for name in ("causal_conv1d_update", "causal_conv1d_update_triton"):
        setattr(module, name, _torch_ops.causal_conv1d_update)
    module.mamba_chunk_scan_combined = _torch_ops.mamba_chunk_scan_combined
    module.selective_state_update = _torch_ops.selective_state_update


def _patch_norm_gate(module: types.ModuleType) -> None:
    module.rms_norm_gated = _torch_ops.rms_norm_gated


def _patch_qwen2_moe(module: types.ModuleType) -> None:
    module.fused_gate_sigmoid_mul = _torch_ops.gate_sigmoid_mul
    module.fused_gate_sigmoid_mul_add = _torch_ops.gate_sigmoid_mul_add


class _WindowSlots:
    """``req_to_token`` as a sliding layer must read it: each full-pool slot indexed out of it
    is translated to its window-pool slot (SGLang's own ``translate_loc_from_full_to_swa``)."""

    def __init__(self, req_to_token: Any, pool: Any) -> None:
        self._req_to_token = req_to_token
        self._pool = pool

    def __getitem__(self, key: Any) -> Any:
        return self._pool.translate_loc_from_full_to_swa(self._req_to_token[key])


class _WindowReqToTokenPool:
    """The one field of the request-to-token pool the forward reads, translated."""

    def __init__(self, req_to_token: Any, pool: Any) -> None:
        self.req_to_token = _WindowSlots(req_to_token, pool)


def _window_reads(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def patched(self: Any, q: Any, k: Any, v: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        pool = self.token_to_kv_pool
        if not (self.use_sliding_window_kv_pool and pool.layers_mapping[layer.layer_id][1]):
            return forward(self, q, k, v, layer, *args, **kwargs)  # not a sliding layer
        full = self.req_to_token_pool
        self.req_to_token_pool = _WindowReqToTokenPool(full.req_to_token, pool)
        try:
            return forward(self, q, k, v, layer, *args, **kwargs)
        finally:
            self.req_to_token_pool = full

    return patched


def _patch_torch_native(module: types.ModuleType) -> None:
    backend = module.TorchNativeAttnBackend
    for name in ("forward_extend", "forward_decode"):
        setattr(backend, name, _window_reads(getattr(backend, name)))


def _patch_mla_dispatch(module: types.ModuleType) -> None:
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    def absorbed(attn: Any, forward_batch: Any) -> Any:
        return AttnForwardMethod.MLA

    module.AttentionBackendRegistry.register("torch_native", absorbed)


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_mla_dispatch,
    "sglang.srt.layers.attention.mamba.mamba": _patch_mamba2,
    "sglang.kernels.ops.attention.fla.fused_norm_gate": _patch_norm_gate,
    "sglang.srt.models.qwen2_moe": _patch_qwen2_moe,
    "sglang.srt.layers.attention.torch_native_backend": _patch_torch_native,
}


_WHAT = {  # what the log line says of each patch
    "sglang.srt.layers.attention.torch_native_backend": "sliding layers read the window pool",
    "sglang.srt.models.deepseek_common.attention_backend_handler": "torch_native: absorbed MLA",
}


def _apply(name: str, module: types.ModuleType) -> None:
    PATCHES[name](module)
    # A marker a test (or a puzzled reader of a module) can check.
    module.__kvbridge_standin_patched__ = True
    what = _WHAT.get(name, "pure-torch kernels")
    logger.info("kvbridge test-only stand-in: patched %s (%s)", name, what)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, name: str, loader: Any) -> None:
        self._name = name
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename...: the original's
        return getattr(self._loader, attr)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(fullname, spec.loader)
        return spec


def install() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return  # not SGLang's CPU path: leave every module as it is
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
    for name in PATCHES:
        module = sys.modules.get(name)
        if module is not None and not getattr(module, "__kvbridge_standin_patched__", False):
            _apply(name, module)
