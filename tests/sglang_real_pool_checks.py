"""kvbridge's transfers over SGLang 0.5.23's REAL KV pool classes, byte for byte, run inside the
SGLang venv by tests/test_sglang_real_pools.py:

    "$KVBRIDGE_SGLANG_PY" tests/sglang_real_pool_checks.py

prints one JSON object last: ``"<case> <prefill TP>-><decode TP>"`` -> "ok" or the failure.

Every rank's pools are SGLang's own classes built on ``device="cpu"`` (they allocate with
``torch.zeros(device=...)`` only), from a tiny model config SGLang itself loads
(``ModelConfig.from_server_args``), at TP ``t`` and rank ``r`` set with SGLang's own parallel
override (``get_parallel().override(attn_tp_size=t, ...)``), so each pool's shapes come from
SGLang's helpers (``mamba2_cache_params`` -> ``Mamba2StateShape.create`` /
``KimiLinearStateShape.create``, ``ModelConfig.get_num_kv_heads``, ``get_hybrid_layer_ids``,
``calculate_mla_kv_cache_dim``, ``dsa_layer_skips_topk``):

- ``mamba2``: Nemotron-H class. ``HybridReqToTokenPool`` (its ``MambaPool``) +
  ``HybridLinearKVPool`` over ``MHATokenToKVPool``; ``mamba2_1g`` the same with one group (every
  rank holds it whole).
- ``gdn``: Qwen3-Next class. The same two classes, GDN shapes.
- ``swa``: gpt-oss class. ``SWAKVPool`` (a full ``MHATokenToKVPool`` and a sliding one).
- ``llama4``: Llama 4 (``Llama4ForConditionalGeneration``): the same ``SWAKVPool``, its
  chunked-attention layers (all but each 4th: ``get_hybrid_layer_ids``) in the sliding one,
  SGLang's window its ``attention_chunk_size`` (``resolve_sliding_window_size``: the model class
  has no window of its own, and Llama 4's text config no sliding_window). Controls: kvbridge
  told a window one token narrower (transformers' cache keeps C - 1) or only the tokens of the
  last chunk (``[n // C * C, n)``, what the next token attends to) must fail the bytes; a config
  whose ``no_rope_layers`` put the chunked layers elsewhere than SGLang's pool must be refused.
- ``mla``: DeepSeek-V3 class. ``MLATokenToKVPool``.
- ``dsa``: DeepSeek-V3.2 class. ``DSATokenToKVPool`` (fp8 latent with scales, page 64, indexer
  keys of index_head_dim 128; one layer reuses the previous top-k and has none).
- ``kda``: Kimi Linear class. ``HybridReqToTokenPool`` (KDA state) + ``HybridLinearKVPool``
  over ``MLATokenToKVPool``.

Each rank's ``KVArgs`` (``sglang.srt.disaggregation.base.conn.KVArgs``) is filled as SGLang's
``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager`` fill it
(``disaggregation/prefill.py``, ``decode.py``): ``get_kv_transfer_buf_infos``,
``build_kv_layer_ids``, the heads (prefill, non-MLA only), the page size, a real
``MetadataBuffers``' ``get_buf_infos`` and ``setup_state_kv_args(kv_args, pool, None, layers,
req_to_token_pool=...)``; kvbridge then reads it as its backend does:
``internals.pool_args(kv_args, place, is_mla_backend(pool), server_args)`` (``is_mla_backend``
is SGLang's, as its queues pass it), ``pools.describe``.

The oracle never asks kvbridge's planner: one logical cache is drawn for the request (every KV
head of every token, the whole state of every layer, the aux row) and each rank's share is
written through SGLang's own accessors (``get_key_buffer(layer)[loc]``,
``mamba2_layer_cache(layer).conv[0][slot]``, the indexer's page views of
``mem_cache/index_key_cache.py``), cut by SGLang's sharding rules:

- KV heads: rank ``r`` of TP ``t`` holds heads ``[r*H/t, (r+1)*H/t)``, or the one head
  ``r*H//t`` where H < t (``get_num_kv_heads`` = max(1, H // t); QKVParallelLinear replicas);
- a conv slot's channels are each segment's share in turn: Mamba2 x | B | C
  (``layers/attention/mamba/mamba.py``: conv1d output sizes [intermediate, groups*N,
  groups*N], each sharded on its own), GDN q | k | v and KDA q | k | v (``conv_shard_groups``
  of ``configs/mamba_utils.py``); GDN and Mamba2 slots are ``[channels, K-1]``, KDA's
  ``[K-1, channels]``;
- a temporal slot holds the rank's heads (``[H/t, ...]``);
- MLA/DSA latents and indexer keys are whole on every rank; an indexer page holds the page's
  128 key bytes of each token, then the 4 scale bytes of each (``IndexKeyCache.move``).

The prefill ranks' pools hold the logical cache's prefill-TP shard (pages of their own table,
their own state slot); kvbridge plans the request (``PrefillPages`` from SGLang's sends, a
decode prefix hit, ``decode_placement`` from the decode's pages and SGLang's state indices,
``Pairing.plan``) and ``kvbridge.memory.copy.execute`` runs every pair; every decode rank's pools
(all their buffers set to canary bytes first) must then equal, byte for byte over every buffer its
``KVArgs`` lists, a twin pool of the same class set to the canary and written with the logical
cache's decode-TP shard for the decode's pages and slot (the tokens past the prefix hit; for a
sliding layer, those of SGLang's window) and nothing else.

Run without ``SGLANG_USE_CPU_ENGINE``: the pools' layouts are then the accelerator ones (under
SGLang's CPU engine it pads GDN heads to the TP size, and an AMX CPU re-lays conv state).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CANARY = 0xA5
AUX_SLOTS = 4
TP_PAIRS = ((1, 1), (2, 1), (1, 2), (2, 4), (4, 2))

_TOKENS = {"vocab_size": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS: dict[str, dict[str, Any]] = {
    # Mamba2 in layers 0 and 3, attention in 1 and 4, an MLP in 2. Four groups: SGLang's
    # Mamba2 weight loader replicates groups only where there is one (mamba.py), so the group
    # count divides every TP size here. Both SGLang's names (mamba_*) and HF's.
    "mamba2": {
        **_TOKENS,
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "hidden_size": 64,
        "layers_block_type": ["mamba", "attention", "mlp", "mamba", "attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,  # replicated at TP 4
        "head_dim": 16,
        "intermediate_size": 128,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 8,
        "n_groups": 4,
        "mamba_n_groups": 4,
        "conv_kernel": 4,
        "mamba_d_conv": 4,
        "expand": 1,
        "mamba_expand": 1,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
    # The same with one group, which SGLang's Mamba2 weight loader gives every rank whole
    # (mamba.py: duplicate_groups), as Falcon-H1's.
    "mamba2_1g": {},
    # GDN in layers 0 and 2, full attention in 1 and 3; K != V so that a transposed state shows.
    "gdn": {
        **_TOKENS,
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
    # Sliding, full, sliding, full. SGLang's scheduler window is gpt-oss's sliding_window - 1
    # (models/gpt_oss.py get_attention_sliding_window_size).
    "swa": {
        **_TOKENS,
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
    "mla": {
        **_TOKENS,
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "intermediate_size": 128,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 3,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
    # Layer 1 reuses layer 0's top-k ("S" of index_topk_pattern): no indexer keys of its own.
    "dsa": {
        **_TOKENS,
        "model_type": "deepseek_v32",
        "architectures": ["DeepseekV32ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 128,  # a multiple of the fp8 latent's 128-element scale blocks
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "index_topk": 64,
        "index_head_dim": 128,
        "index_n_heads": 4,
        "index_topk_pattern": "FSF",
        "intermediate_size": 128,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 3,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
    # KDA in layers 0 and 2 (1-based in the config), MLA in layer 1.
    "kda": {
        **_TOKENS,
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2],
            "num_heads": 4,
            "head_dim": 8,
            "short_conv_kernel_size": 4,
        },
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    },
}
CONFIGS["mamba2_1g"] = {**CONFIGS["mamba2"], "n_groups": 1, "mamba_n_groups": 1}
# Llama 4: chunked layers 0-2 and 4-6, full (NoPE) layers 3 and 7. A chunk of 20 tokens (not a
# page multiple): a 45-token request's window is tokens [25, 45), its last chunk [40, 45).
LLAMA4_TEXT: dict[str, Any] = {
    **_TOKENS,
    "model_type": "llama4_text",
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "intermediate_size_mlp": 128,
    "num_local_experts": 4,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": 20,
    "no_rope_layers": [],  # as the published checkpoints: transformers' default (every 4th NoPE)
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
CONFIGS["llama4"] = {
    "model_type": "llama4",
    "architectures": ["Llama4ForConditionalGeneration"],
    "text_config": LLAMA4_TEXT,
    "torch_dtype": "bfloat16",
}
CASES = tuple(CONFIGS)
# A Llama 4 whose config makes layers 2 and 6 the NoPE ones: SGLang 0.5.23 ignores that
# (models/llama4.py: use_rope = (layer_id + 1) % 4 != 0) and pools layers as for any Llama 4.
CONTROL_CONFIGS = {
    "llama4_norope": {
        **CONFIGS["llama4"],
        "text_config": {**LLAMA4_TEXT, "no_rope_layers": [1, 1, 0, 1, 1, 1, 0, 1]},
    }
}
CONTROLS = (
    "llama4 control window-1 2->1",
    "llama4 control last-chunk 1->2",
    "llama4_norope refused",
)
KIND = {"llama4": "swa", "llama4_norope": "swa"}  # cases whose pools are another case's type
# (prefill page, decode page, pool tokens, request tokens): DSA's indexer needs 64-token pages;
# the others page 4 -> 8 on even TP pairs and 8 -> 4 on odd ones.
PAGING = {"dsa": (64, 64, 64 * 8, 150)}
DEFAULT_PAGING = (4, 8, 192, 45)
KV_DTYPE = {"dsa": "fp8_e4m3"}  # DeepSeek-V3.2's KV cache on the GPUs that run it


def held(units: int, tp: int, rank: int) -> list[int]:
    """The units of a segment a rank holds (SGLang's sharding: a block each, or one
    replicated unit where there are fewer units than ranks)."""
    if units >= tp:
        n = units // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank * units // tp]


def view(ptr: int, nbytes: int) -> np.ndarray:
    """The bytes at an address (a pool tensor's), as a writable uint8 array."""
    if not nbytes:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def as_bytes(t: Any) -> Any:
    """A tensor's storage as uint8 (the last axis widened by the item size)."""
    import torch

    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def put(buf: Any, index: np.ndarray, rows: np.ndarray) -> None:
    import torch

    if len(index):
        as_bytes(buf)[torch.from_numpy(index.astype(np.int64))] = torch.from_numpy(rows)


# ---------------------------------------------------------------------------------------------
# SGLang: models, parallel state, pools, KVArgs


@dataclass
class Model:
    name: str
    path: Path
    server_args: Any
    config: Any  # SGLang's ModelConfig

    @property
    def kind(self) -> str:
        """The pool type (a case's name, less its variant)."""
        return KIND.get(self.name, self.name.split("_")[0])

    @staticmethod
    def load(name: str, root: Path) -> Model:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.runtime_context import get_context
        from sglang.srt.server_args import ServerArgs

        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**CONFIGS, **CONTROL_CONFIGS}[name]))
        kwargs = {"kv_cache_dtype": KV_DTYPE[name]} if name in KV_DTYPE else {}
        server_args = ServerArgs(
            model_path=str(path), device="cpu", skip_tokenizer_init=True, **kwargs
        )
        get_context().set_server_args(server_args)  # SGLang's global server args
        return Model(name, path, server_args, ModelConfig.from_server_args(server_args))


@contextlib.contextmanager
def parallel(tp: int, rank: int) -> Iterator[None]:
    """SGLang's parallel state as on attention-TP rank ``rank`` of ``tp`` (one server, no
    DP/CP/PP), through its own override."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(
        tp_size=tp,
        tp_rank=rank,
        attn_tp_size=tp,
        attn_tp_rank=rank,
        attn_dp_size=1,
        attn_dp_rank=0,
        attn_cp_size=1,
        attn_cp_rank=0,
        attn_dcp_size=1,
        pp_size=1,
        pp_rank=0,
        moe_tp_size=tp,
        moe_ep_size=1,
        moe_dp_size=1,
    ):
        yield


@dataclass
class Pools:
    kv: Any  # token_to_kv_pool
    req: Any  # req_to_token_pool
    kv_dtype: str | None = None  # KVArgs.kv_cache_dtype_str where not "auto"


def build_pools(model: Model, tp: int, rank: int, page: int, tokens: int) -> Pools:
    """One rank's pools, as SGLang's KVCacheConfigurator builds them for this model class
    (mem_cache/kv_cache_configurator.py), small."""
    import torch
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import dsa_layer_skips_topk, get_hybrid_layer_ids
    from sglang.srt.mem_cache import kv_cache_configurator as kvc
    from sglang.srt.mem_cache.memory_pool import (
        DSATokenToKVPool,
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    mc = model.config
    common = {"device": "cpu", "enable_memory_saver": False}
    reqs, context = 4, 512
    with parallel(tp, rank):
        heads = mc.get_num_kv_heads(tp)
        if model.kind in ("mamba2", "gdn", "kda"):
            hf = mambaish_config(mc)
            params = hf.mamba2_cache_params
            req = HybridReqToTokenPool(
                size=reqs,
                mamba_size=6,
                mamba_spec_state_size=reqs,
                max_context_len=context,
                cache_params=params,
                mamba_layer_ids=list(params.layers),
                enable_mamba_extra_buffer=False,
                speculative_num_draft_tokens=None,
                enable_overlap_schedule=False,
                **common,
            )
            mla = model.kind == "kda"
            extra = (
                {"kv_lora_rank": mc.kv_lora_rank, "qk_rope_head_dim": mc.qk_rope_head_dim}
                if mla
                else {}
            )
            kv = HybridLinearKVPool(
                page_size=page,
                size=tokens,
                dtype=torch.bfloat16,
                head_num=heads,
                head_dim=mc.head_dim,
                full_attention_layer_ids=list(hf.full_attention_layer_ids),
                mamba_pool=req.mamba_pool,
                use_mla=mla,
                **extra,
                **common,
            )
            return Pools(kv, req)
        req = ReqToTokenPool(size=reqs, max_context_len=context, **common)
        if model.kind == "swa":
            swa_ids, full_ids = get_hybrid_layer_ids(mc.hf_config.architectures, mc.hf_text_config)
            kv = SWAKVPool(
                size=tokens,
                size_swa=tokens // 2,
                page_size=page,
                dtype=torch.bfloat16,
                head_num=heads,
                head_dim=mc.head_dim,
                swa_attention_layer_ids=swa_ids,
                full_attention_layer_ids=full_ids,
                **common,
            )
            return Pools(kv, req)
        if model.kind == "mla":
            kv = MLATokenToKVPool(
                tokens,
                page_size=page,
                dtype=torch.bfloat16,
                kv_lora_rank=mc.kv_lora_rank,
                qk_rope_head_dim=mc.qk_rope_head_dim,
                layer_num=mc.num_hidden_layers,
                **common,
            )
            return Pools(kv, req)
        if model.kind == "dsa":
            dtype = torch.float8_e4m3fn
            skip = {}
            if kvc._should_elide_dsa_index_k(is_draft_worker=False):
                skip["skip_topk_layers"] = [
                    dsa_layer_skips_topk(mc.hf_config, i) for i in range(mc.num_hidden_layers)
                ]
            kv = DSATokenToKVPool(
                tokens,
                page_size=page,
                dtype=dtype,
                kv_lora_rank=mc.kv_lora_rank,
                qk_rope_head_dim=mc.qk_rope_head_dim,
                layer_num=mc.num_hidden_layers,
                kv_cache_dim=kvc.calculate_mla_kv_cache_dim(model_config=mc, kv_cache_dtype=dtype),
                index_head_dim=mc.hf_config.index_head_dim,
                **skip,
                **common,
            )
            return Pools(kv, req, "fp8_e4m3")
    raise ValueError(model.name)


def kv_args_of(model: Model, pools: Pools, meta: Any, prefill: bool) -> Any:
    """The rank's KVArgs, filled as SGLang's prefill/decode queues fill them."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import (
        build_kv_layer_ids,
        get_kv_transfer_buf_infos,
        is_mla_backend,
        setup_state_kv_args,
    )

    mc = model.config
    args = KVArgs()
    args.engine_rank = 0
    args.kv_cache_dtype_str = pools.kv_dtype or "auto"
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(pools.kv)
    args.num_draft_entries = 0
    args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=pools.kv,
        draft_token_to_kv_pool=None,
        num_draft_entries=0,
        num_hidden_layers=mc.num_hidden_layers,
    )
    if prefill and not is_mla_backend(pools.kv):  # the decode sets no heads
        args.kv_head_num = pools.kv.head_num
        args.total_kv_head_num = mc.get_total_num_kv_heads()
    args.page_size = pools.kv.page_size
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = meta.get_buf_infos()
    setup_state_kv_args(args, pools.kv, None, mc.num_hidden_layers, req_to_token_pool=pools.req)
    return args


# ---------------------------------------------------------------------------------------------
# The logical cache and how SGLang shards and stores it


@dataclass
class Request:
    tokens: int
    start: int  # the decode's prefix hit (whole decode pages)
    window: int | None  # SGLang's scheduler window (sliding layers)


@dataclass
class Logical:
    """One request's whole cache, drawn once: bytes of every token's every KV head, latent
    and indexer key, of every layer's whole state; what every rank is cut from."""

    kv: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # [tokens, heads, B]
    conv: dict[int, np.ndarray] = field(default_factory=dict)  # [channels, K-1, width]
    temporal: dict[int, np.ndarray] = field(default_factory=dict)  # [heads, bytes]
    aux: list[np.ndarray] = field(default_factory=list)


class Layout:
    """Where one model class's logical cache lies in one rank's SGLang pools, and how each
    segment is sharded (SGLang's rules, module docstring)."""

    def __init__(self, model: Model) -> None:
        self.model, self.mc = model, model.config
        self.hf = self.mc.hf_config
        name = model.kind
        self.full: list[int] = []
        self.sliding: list[int] = []
        self.mamba: list[int] = []
        self.latent = name in ("mla", "dsa", "kda")
        if name in ("mamba2", "gdn", "kda"):
            from sglang.srt.configs.hybrid_arch import mambaish_config

            hf = mambaish_config(self.mc)
            self.full = list(hf.full_attention_layer_ids)
            with parallel(1, 0):
                shape = hf.mamba2_cache_params.shape
                self.mamba = list(hf.mamba2_cache_params.layers)
            self.k_1 = shape.conv_kernel - 1
            # A conv slot is [channels, K-1], except where SGLang slices its second axis
            # (KimiLinearStateShape.conv_slice_axis: [K-1, channels]).
            self.window_first = getattr(shape, "conv_slice_axis", 0) == 1
        elif name == "swa":
            from sglang.srt.configs.model_config import get_hybrid_layer_ids

            self.sliding, self.full = get_hybrid_layer_ids(
                self.hf.architectures, self.mc.hf_text_config
            )
        else:
            self.full = list(range(self.mc.num_hidden_layers))
        self.indexed: list[int] = []
        if name == "dsa":
            from sglang.srt.configs.model_config import dsa_layer_skips_topk

            self.indexed = [i for i in self.full if not dsa_layer_skips_topk(self.hf, i)]

    # The conv segments (units, unit channels) in SGLang's order, and the temporal heads.
    def conv_segments(self) -> list[tuple[int, int]]:
        h = self.hf
        if self.model.kind == "mamba2":
            groups = h.n_groups
            return [
                (h.mamba_num_heads, h.mamba_head_dim),
                (groups, h.ssm_state_size),
                (groups, h.ssm_state_size),
            ]
        if self.model.kind == "gdn":
            hk, hv = h.linear_num_key_heads, h.linear_num_value_heads
            return [
                (hk, h.linear_key_head_dim),
                (hk, h.linear_key_head_dim),
                (hv, h.linear_value_head_dim),
            ]
        c = h.linear_attn_config  # KDA: q | k | v, num_heads heads of head_dim each
        return [(c["num_heads"], c["head_dim"])] * 3

    def temporal_heads(self) -> int:
        h = self.hf
        return {
            "mamba2": lambda: h.mamba_num_heads,
            "gdn": lambda: h.linear_num_value_heads,
            "kda": lambda: h.linear_attn_config["num_heads"],
        }[self.model.kind]()

    def conv_rows(self, tp: int, rank: int) -> list[int]:
        rows, base = [], 0
        for units, size in self.conv_segments():
            for u in held(units, tp, rank):
                rows.extend(range(base + u * size, base + (u + 1) * size))
            base += units * size
        return rows

    def draw(self, pools: Pools, req: Request, meta: Any, rng: np.random.Generator) -> Logical:
        """The logical cache, its byte widths read from a TP 1 rank's pools."""
        out = Logical()
        n = req.tokens
        total = self.mc.get_total_num_kv_heads()
        for lid in self.full + self.sliding:
            if self.latent:
                width = as_bytes(pools.kv.get_key_buffer(lid)).shape[-1]
                out.kv[(lid, "latent")] = rng.integers(0, 256, (n, 1, width), np.uint8)
                continue
            for which, get in (("k", pools.kv.get_key_buffer), ("v", pools.kv.get_value_buffer)):
                width = as_bytes(get(lid)).shape[-1]
                out.kv[(lid, which)] = rng.integers(0, 256, (n, total, width), np.uint8)
        for lid in self.indexed:
            out.kv[(lid, "index_k")] = rng.integers(0, 256, (n, 1, 128), np.uint8)
            out.kv[(lid, "index_scale")] = rng.integers(0, 256, (n, 1, 4), np.uint8)
        for lid in self.mamba:
            cache = pools.req.mamba2_layer_cache(lid)
            (conv,) = cache.conv
            channels = sum(u * s for u, s in self.conv_segments())
            shape = (channels, self.k_1, conv.element_size())
            out.conv[lid] = rng.integers(0, 256, shape, np.uint8)
            unit = as_bytes(cache.temporal[0]).reshape(cache.temporal.shape[1], -1).shape[-1]
            out.temporal[lid] = rng.integers(0, 256, (self.temporal_heads(), unit), np.uint8)
        for _, _, item in zip(*meta.get_buf_infos(), strict=True):
            out.aux.append(rng.integers(0, 256, item, np.uint8))
        return out

    def write(
        self,
        pools: Pools,
        meta: Any,
        logical: Logical,
        tp: int,
        rank: int,
        req: Request,
        tables: dict[str, np.ndarray],
        page: int,
        slots: dict[str, int],
        first: int,
    ) -> None:
        """Rank ``rank`` of TP ``tp``'s share of the logical cache, through SGLang's accessors:
        tokens ``[first, tokens)`` at the pages of ``tables`` (a sliding layer's only those of
        SGLang's window), the state at ``slots['state']``, the aux row at ``slots['aux']``."""
        import torch

        n = req.tokens
        heads = held(self.mc.get_total_num_kv_heads(), tp, rank)

        def locs(table: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray]:
            t = np.arange(lo, n)
            return t, table[t // page] * page + t % page

        for (lid, which), arr in logical.kv.items():
            sliding = lid in self.sliding
            lo = max(first, n - req.window) if sliding and req.window else first
            t, loc = locs(tables["swa" if sliding else "kv"], lo)
            if which == "latent":
                put(pools.kv.get_key_buffer(lid), loc, arr[t])
            elif which in ("k", "v"):
                get = pools.kv.get_key_buffer if which == "k" else pools.kv.get_value_buffer
                put(get(lid), loc, arr[t][:, heads])
            else:  # the indexer: a page is its tokens' 128 key bytes, then their 4 scale bytes
                # (IndexKeyCache.move's views of a page)
                buf = pools.kv.index_key_cache.buffer[lid]
                keys = buf[:, : page * 128].view(buf.shape[0], page, 128)
                scales = buf[:, page * 128 :].view(buf.shape[0], page, 4)
                dst = keys if which == "index_k" else scales
                pages = torch.from_numpy(loc // page)
                dst[pages, torch.from_numpy(loc % page)] = torch.from_numpy(arr[t][:, 0])
        for lid in self.mamba:
            rows = self.conv_rows(tp, rank)
            temporal_heads = held(self.temporal_heads(), tp, rank)
            cache = pools.req.mamba2_layer_cache(lid)
            (conv,) = cache.conv
            shard = logical.conv[lid][rows]  # [channels, K-1, width]
            if self.window_first:  # KDA: [K-1, channels]
                shard = shard.transpose(1, 0, 2)
            slot = slots["state"]
            as_bytes(conv)[slot] = _tensor(shard.reshape(shard.shape[0], -1))
            temporal = as_bytes(cache.temporal[slot]).reshape(len(temporal_heads), -1)
            temporal[:] = _tensor(logical.temporal[lid][temporal_heads])
        for buf, row in zip(_meta_bufs(meta), logical.aux, strict=True):
            as_bytes(buf[slots["aux"]]).reshape(-1)[:] = _tensor(row)


def _tensor(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


def _meta_bufs(meta: Any) -> list[Any]:
    """MetadataBuffers' tensors in get_buf_infos() order (matched by address)."""
    tensors = [v for v in vars(meta).values() if hasattr(v, "data_ptr")]
    by_ptr = {t.data_ptr(): t for t in tensors}
    return [by_ptr[p] for p in meta.get_buf_infos()[0]]


# ---------------------------------------------------------------------------------------------
# One rank, as kvbridge's backend sees it


class Rank:
    def __init__(
        self,
        model: Model,
        tp: int,
        rank: int,
        page: int,
        tokens: int,
        prefill: bool,
        window: int | None = None,
    ) -> None:
        import torch
        from sglang.srt.disaggregation.utils import MetadataBuffers, is_mla_backend

        from kvbridge.integrations.sglang import internals
        from kvbridge.integrations.sglang.pools import AuxPacker, describe

        self.tp, self.rank, self.page = tp, rank, page
        self.pools = build_pools(model, tp, rank, page, tokens)
        self.meta = MetadataBuffers(
            size=AUX_SLOTS,
            hidden_size=model.config.hidden_size,
            hidden_states_dtype=torch.bfloat16,
            max_sampling_mask_tokens=model.server_args.sampling_mask_max_tokens,
        )
        self.kv_args = kv_args_of(model, self.pools, self.meta, prefill)
        place = internals.Place(tp, rank, 1, 1, "127.0.0.1", 0, "auto")
        self.mla = is_mla_backend(self.pools.kv)  # what SGLang's queues pass its backend
        # What kvbridge's hook notes before the queue builds its KV manager: the scheduler's
        # window and the pool's sliding-window layers.
        internals.note_pools(window, self.pools.kv)
        try:
            self.args = internals.pool_args(self.kv_args, place, self.mla, model.server_args)
            self.d = describe(self.args)
        except Exception as e:
            a = self.kv_args
            raise AssertionError(
                f"kvbridge refused SGLang's real {type(self.pools.kv).__name__} "
                f"({'prefill' if prefill else 'decode'} TP {tp} rank {rank}): {e}. SGLang passed "
                f"is_mla_backend={self.mla}, KVArgs.is_hybrid_mla_backend="
                f"{getattr(a, 'is_hybrid_mla_backend', None)}, kv_head_num="
                f"{getattr(a, 'kv_head_num', None)}, total_kv_head_num="
                f"{getattr(a, 'total_kv_head_num', None)}, kv_layer_ids={a.kv_layer_ids}, "
                f"{len(a.kv_data_ptrs)} KV buffers of {sorted(set(a.kv_item_lens))}-byte pages, "
                f"state types {[getattr(t, 'value', t) for t in a.state_types]}"
            ) from e
        self.kvb_aux = np.zeros(self.d.memory.region("aux").nbytes, np.uint8)
        self.packer = AuxPacker(
            self.kvb_aux.ctypes.data,
            tuple(self.kv_args.aux_data_ptrs),
            tuple(self.kv_args.aux_item_lens),
        )
        self.regions = {n: view(p, b) for n, p, b in self.d.regions}
        self.regions["aux"] = self.kvb_aux

    def buffers(self) -> list[tuple[str, int, int, int]]:
        """Every buffer SGLang's KVArgs lists: (label, address, bytes, item bytes)."""
        a = self.kv_args
        out = []
        ids = list(a.kv_layer_ids or [])
        for i, (p, n, item) in enumerate(
            zip(a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens, strict=True)
        ):
            out.append((f"kv[{i}]" + (f" layer {ids[i]}" if ids else ""), p, n, item))
        for s, kind in enumerate(a.state_types):
            lids = a.state_layer_ids[s] if s < len(a.state_layer_ids) else []
            for i, (p, n, item) in enumerate(
                zip(a.state_data_ptrs[s], a.state_data_lens[s], a.state_item_lens[s], strict=True)
            ):
                label = f"state {getattr(kind, 'value', kind)}[{i}]"
                out.append((label + (f" layer {lids[i]}" if lids else ""), p, n, item))
        for i, (p, n, item) in enumerate(
            zip(a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens, strict=True)
        ):
            out.append((f"aux[{i}]", p, n, item))
        return out

    def fill(self, byte: int) -> None:
        for _, p, n, _ in self.buffers():
            if n:
                ctypes.memset(p, byte, n)


# ---------------------------------------------------------------------------------------------
# One transfer, checked


def table(n_pages: int, pool_pages: int, rng: np.random.Generator) -> np.ndarray:
    """Distinct page ids, never SGLang's padding page 0."""
    return rng.choice(np.arange(1, pool_pages), size=n_pages, replace=False).astype(np.int64)


def sglang_window(model: Model) -> int | None:
    """The scheduler's sliding window, as SGLang resolves it for this model."""
    if model.name.startswith("llama4"):
        from sglang.srt.model_executor.model_runner_components.load_model_utils import (
            resolve_sliding_window_size,
        )
        from sglang.srt.models.mllama4 import Llama4ForConditionalGeneration

        # The model class gives no window of its own, so SGLang takes attention_chunk_size.
        assert not hasattr(Llama4ForConditionalGeneration, "get_attention_sliding_window_size")
        window = resolve_sliding_window_size(Llama4ForConditionalGeneration, model.config)
        assert window == LLAMA4_TEXT["attention_chunk_size"], window
        return int(window)
    window = CONFIGS[model.name].get("sliding_window")
    # gpt-oss: the config's less one (models/gpt_oss.py get_attention_sliding_window_size).
    return window - 1 if window else None


def check_pair(
    model: Model,
    layout: Layout,
    ptp: int,
    dtp: int,
    seed: int,
    flip: bool,
    kvb_window: int | None = None,
) -> str:
    """``kvb_window``: the window kvbridge is told (SGLang's where None: the controls tell it
    another, and the bytes must then differ)."""
    import torch
    from sglang.srt.mem_cache.common import (
        kv_to_page_indices,
        page_align_floor,
        suffix_page_indices,
    )

    from kvbridge.integrations.sglang.pools import PrefillPages, decode_placement
    from kvbridge.integrations.sglang.states import StateIndices
    from kvbridge.memory.copy import execute
    from kvbridge.planner.parallel import ParallelLayout
    from kvbridge.planner.plan import Pairing, Side

    rng = np.random.default_rng(seed)
    ppage, dpage, pool_tokens, n = PAGING.get(model.kind, DEFAULT_PAGING)
    if flip:
        ppage, dpage = dpage, ppage
    window = sglang_window(model)  # the oracle's and SGLang's window page lists'
    told = kvb_window or window  # what kvbridge's hook notes from the scheduler
    # A decode prefix hit of a whole decode page where the request has three or more.
    start = dpage if n > 2 * dpage else 0
    req = Request(n, start, window)

    prefill = [Rank(model, ptp, r, ppage, pool_tokens, True, told) for r in range(ptp)]
    decode = [Rank(model, dtp, r, dpage, pool_tokens, False, told) for r in range(dtp)]
    twins = [Rank(model, dtp, r, dpage, pool_tokens, False, told) for r in range(dtp)]
    whole = build_pools(model, 1, 0, ppage, pool_tokens)  # TP 1: every head, every channel
    logical = layout.draw(whole, req, prefill[0].meta, rng)

    def tables(page: int) -> dict[str, np.ndarray]:
        pages = -(-n // page)
        out = {"kv": table(pages, pool_tokens // page + 1, rng)}
        if layout.sliding:
            out["swa"] = table(pages, pool_tokens // 2 // page + 1, rng)
        return out

    p_tab, d_tab = tables(ppage), tables(dpage)
    p_slots = {"state": int(rng.integers(0, 6)), "aux": int(rng.integers(0, AUX_SLOTS))}
    d_slots = {"state": int(rng.integers(0, 6)), "aux": int(rng.integers(0, AUX_SLOTS))}

    # The prefill's forward filled its pools and its metadata row (SGLang's set_buf).
    for pr in prefill:
        layout.write(pr.pools, pr.meta, logical, ptp, pr.rank, req, p_tab, ppage, p_slots, 0)
    for dr in (*decode, *twins):
        dr.fill(CANARY)
    for tw in twins:
        layout.write(tw.pools, tw.meta, logical, dtp, tw.rank, req, d_tab, dpage, d_slots, start)

    # SGLang's state indices (prefill.py / decode.py send_kv_chunk's payloads), from each
    # side's req_to_token row (token -> slot id) and its SWA row.
    def state_payloads(rank: Rank, tab: dict[str, np.ndarray], page: int, slot: int) -> list:
        t = np.arange(n)
        row = torch.from_numpy(tab["kv"][t // page] * page + t % page)
        out = []
        for st in rank.kv_args.state_types:
            kind = getattr(st, "value", st)
            if kind == "mamba":
                out.append([torch.tensor(slot).cpu().numpy()])
            elif kind == "swa":
                swa_row = torch.from_numpy(tab["swa"][t // page] * page + t % page)
                lo = page_align_floor(max(start, n - window), page)
                out.append(kv_to_page_indices(swa_row[lo:n], page))
            elif kind == "dsa":
                rows = torch.zeros((1, 1024), dtype=torch.int64)
                rows[0, :n] = row
                out.append(suffix_page_indices(rows, 0, start, n, page))
            else:
                raise AssertionError(f"state type {kind}: no payload written here")
        return out

    p0, d0 = prefill[0], decode[0]
    d_given = state_payloads(d0, d_tab, dpage, d_slots["state"])
    dst = decode_placement(
        n,
        start,
        dpage,
        d_tab["kv"][start // dpage :].tolist(),
        d_slots["aux"],
        StateIndices.parse(d0.args.states, d_given),
    )
    layers = len(p0.d.spec.layers)
    pairing = Pairing(
        Side(p0.d.spec, ParallelLayout(ptp, ((0, layers),)), p0.d.memory),
        Side(d0.d.spec, ParallelLayout(dtp, ((0, layers),)), d0.d.memory),
    )
    for pr in prefill:
        pr.packer.pack(p_slots["aux"])
    # SGLang's sends: the first chunk ends on a prefill page, the state indices and the aux
    # with the last; a window's pages are named only then, so such a request goes whole.
    pp = PrefillPages(n, start, ppage, p_slots["aux"])
    stops = [n] if layout.sliding else [(start + n) // 2 // ppage * ppage, n]
    begin = start
    for stop in stops:
        if stop <= pp.stop:
            continue
        last = stop == n
        sent = p_tab["kv"][pp.stop // ppage : -(-stop // ppage)]
        given = state_payloads(p0, p_tab, ppage, p_slots["state"]) if last else None
        states = StateIndices.parse(p0.args.states, given) if last else StateIndices()
        pp.add(sent.tolist(), stop - pp.stop, states)
        plan = pairing.plan(pp.placement(), dst, begin, stop)
        begin = stop
        for pair in plan.pairs:
            names_s, names_d, runs = pair.runs.restricted(plan.src_regions, plan.dst_regions)
            execute(
                runs,
                [prefill[pair.prefill_rank].regions[x] for x in names_s],
                [decode[pair.decode_rank].regions[x] for x in names_d],
            )
    for dr in decode:
        dr.packer.unpack(d_slots["aux"])

    problems = []
    for dr, tw in zip(decode, twins, strict=True):
        got_bufs, want_bufs = dr.buffers(), tw.buffers()
        for (label, p, nb, item), (_, tp_, tn, _) in zip(got_bufs, want_bufs, strict=True):
            got, want = view(p, nb), view(tp_, tn)
            if got.shape != want.shape:
                problems.append(f"decode rank {dr.rank} {label}: {nb} bytes, expected {tn}")
                continue
            bad = np.flatnonzero(got != want)
            if len(bad):
                at = int(bad[0])
                problems.append(
                    f"decode rank {dr.rank} {label}: {len(bad)} of {nb} bytes differ, first at "
                    f"byte {at} (item {at // item} of {item} bytes, offset {at % item}): got "
                    f"{got[at : at + 8].tolist()}, expected {want[at : at + 8].tolist()}"
                )
    # The oracle itself: every decode rank expects the request's bytes in every pool buffer
    # that has items (not a canary-only comparison).
    for tw in twins:
        for label, p, nb, _ in tw.buffers():
            if nb and not label.startswith("aux") and not np.any(view(p, nb) != CANARY):
                problems.append(f"the oracle wrote nothing into decode rank {tw.rank} {label}")
    if problems:
        raise AssertionError(
            f"{model.name} TP {ptp}->{dtp}, pages {ppage}->{dpage}, {n} tokens, prefix {start}: "
            + "; ".join(problems[:6])
            + (f" (+{len(problems) - 6} more)" if len(problems) > 6 else "")
        )
    return "ok"


def controls(root: Path) -> dict[str, str]:
    """Llama 4 described wrongly on purpose: each result is "ok" only where the grid failed (or
    kvbridge refused) as it must."""
    import torch

    out: dict[str, str] = {}
    model = Model.load("llama4", root)
    layout = Layout(model)
    c, n = LLAMA4_TEXT["attention_chunk_size"], DEFAULT_PAGING[3]
    wrong = {
        CONTROLS[0]: c - 1,  # what transformers' cache keeps of a chunked layer
        CONTROLS[1]: n - n // c * c,  # the last chunk's tokens: what the next token attends to
    }
    for key, told in wrong.items():
        ptp, dtp = (int(x) for x in key.split()[-1].split("->"))
        try:
            with torch.no_grad():
                check_pair(model, layout, ptp, dtp, seed=77, flip=ptp > dtp, kvb_window=told)
            out[key] = f"the bytes matched with kvbridge told a window of {told} (SGLang: {c})"
        except AssertionError as e:
            out[key] = "ok" if "bytes differ" in str(e) else traceback.format_exc()
        except Exception:
            out[key] = traceback.format_exc()
    key = CONTROLS[2]
    try:
        bad = Model.load("llama4_norope", root)
        # SGLang pools it as any Llama 4 (its own split, whatever the config says) ...
        assert Layout(bad).sliding == layout.sliding == [0, 1, 2, 4, 5, 6], Layout(bad).sliding
        Rank(bad, 1, 0, 4, 192, True, c)
        out[key] = "kvbridge described a config whose chunked layers are not SGLang's pool's"
    except AssertionError as e:
        # ... and kvbridge refuses it, naming both.
        want = "sliding-window pool holds layers [0, 1, 2, 4, 5, 6]"
        out[key] = "ok" if want in str(e) and "[0, 1, 3, 4, 5, 7]" in str(e) else str(e)
    except Exception:
        out[key] = traceback.format_exc()
    return out


def main() -> None:
    import torch

    torch.set_num_threads(1)
    only = set(sys.argv[1:])
    results: dict[str, str] = {}
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvbridge-real-pools-") as tmp:
        for i, name in enumerate(CASES):
            if only and name not in only:
                continue
            began = time.monotonic()
            try:
                model = Model.load(name, Path(tmp))
                layout = Layout(model)
            except Exception:
                for ptp, dtp in TP_PAIRS:
                    results[f"{name} {ptp}->{dtp}"] = "setup: " + traceback.format_exc()
                continue
            for j, (ptp, dtp) in enumerate(TP_PAIRS):
                key = f"{name} {ptp}->{dtp}"
                try:
                    with torch.no_grad():
                        results[key] = check_pair(
                            model, layout, ptp, dtp, seed=1000 * i + j, flip=bool(j % 2)
                        )
                except Exception:
                    results[key] = traceback.format_exc()
            timings[name] = round(time.monotonic() - began, 2)
        if not only or "llama4" in only:
            began = time.monotonic()
            try:
                results.update(controls(Path(tmp)))
            except Exception:
                results.update(dict.fromkeys(CONTROLS, "setup: " + traceback.format_exc()))
            timings["controls"] = round(time.monotonic() - began, 2)
    print(json.dumps(timings), file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
