"""vLLM's KV memory layouts (kvbridge.integrations.vllm.memory) against the byte oracle: the
CPU backend's transposed K, CUDA's NHD and HND, between any TP sizes and block sizes, and the
descriptor count when both sides are vLLM CPU with whole blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge import DType, KVLayout, ParallelLayout, Placement, Side, build_memory
from kvbridge.errors import LayoutError
from kvbridge.integrations.vllm.memory import VllmLayout, layout_of, state_bytes, vllm_memory
from kvbridge.model.spec import CacheSpec, attention_layer, gdn_layer, mamba2_layer, mla_layer
from kvbridge.planner.layout import ConvLayout
from oracle import check_bytes

SPEC = CacheSpec("tiny-llama", tuple(attention_layer(4, 8, DType.FLOAT32) for _ in range(3)))


def side(tp: int, layout: VllmLayout | KVLayout, block: int, blocks: int = 24) -> Side:
    par = ParallelLayout.even(SPEC.num_layers, tp)
    if isinstance(layout, VllmLayout):
        mem = vllm_memory(SPEC, tp, num_blocks=blocks, block_size=block, layout=layout)
    else:
        mem = build_memory(SPEC, par, page_size=block, num_pages=blocks, kv_layout=layout)
    return Side(SPEC, par, mem)


def pages(n: int, block: int, blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(blocks)[: -(-n // block)]


@pytest.mark.parametrize("src", list(VllmLayout) + [KVLayout.NHD])
@pytest.mark.parametrize("dst", list(VllmLayout) + [KVLayout.HND])
@pytest.mark.parametrize(
    ("tp_p", "tp_d", "bp", "bd"), [(1, 1, 8, 8), (2, 1, 8, 4), (1, 2, 4, 16), (4, 2, 16, 8)]
)
def test_vllm_layouts_match_the_reference(
    src: VllmLayout | KVLayout, dst: VllmLayout | KVLayout, tp_p: int, tp_d: int, bp: int, bd: int
) -> None:
    n = 37  # the last block of each side is partial
    check_bytes(
        side(tp_p, src, bp),
        side(tp_d, dst, bd),
        Placement.simple(n, pages(n, bp, 24, 1)),
        Placement.simple(n, pages(n, bd, 24, 2), aux_slot=3),
        [(0, 20), (20, n)],
    )


def test_cpu_to_cpu_whole_blocks_is_one_run_per_block_head_and_half() -> None:
    # K transposed is one [head_size, block] slab per (block, head): the per-element pieces
    # merge across tokens and elements, so whole blocks cost what a contiguous copy costs.
    n, block = 64, 16
    p, d = side(1, VllmLayout.CPU, block), side(1, VllmLayout.CPU, block)
    src, dst = Placement.simple(n, [5, 2, 9, 0]), Placement.simple(n, [1, 7, 3, 4])
    pairing = check_bytes(p, d, src, dst)
    runs = pairing.plan(src, dst).pair(0, 0)
    assert runs is not None
    # per layer: 4 blocks x 4 heads x (K slab + V slab), plus aux
    assert len(runs.runs) <= SPEC.num_layers * 4 * 4 * 2 + 1, len(runs.runs)


def test_regions_are_the_tensors_vllm_allocates_and_cuda_layouts_are_read_from_strides() -> None:
    mem = vllm_memory(
        SPEC,
        2,
        num_blocks=10,
        block_size=32,
        layout=VllmLayout.CPU,
        layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(3)],
    )
    # 10 blocks x 2 local heads x 32 tokens x 2*8 elements x 4 bytes
    assert mem.region("model.layers.0.self_attn.attn").nbytes == 10 * 2 * 32 * 16 * 4
    shape = (10, 2, 32, 16)  # [B, H, N, 2D]
    # LBNHC: [B, N, H, 2D] in memory, viewed as [B, H, N, 2D]; LBHNC: contiguous [B, H, N, 2D]
    assert layout_of((32 * 2 * 16, 16, 2 * 16, 1), shape) is VllmLayout.NHD
    assert layout_of((2 * 32 * 16, 32 * 16, 16, 1), shape) is VllmLayout.HND
    with pytest.raises(LayoutError, match="neither LBNHC"):
        layout_of((1, 10, 20, 640), shape)


def test_cuda_layouts_hold_k_then_v_in_each_token_and_head() -> None:
    # vLLM's FlashAttention splits [B, H, N, 2D] as transpose(1, 2).split(D, -1): K is the
    # first D elements of each (token, head), V the next D. Check the buffers say the same.
    for layout in (VllmLayout.NHD, VllmLayout.HND):
        mem = vllm_memory(SPEC, 1, num_blocks=3, block_size=4, layout=layout)
        nbytes = mem.region("L0").nbytes
        cache = np.arange(nbytes // 4, dtype=np.float32)
        strides = (
            (4 * 4 * 16, 16, 4 * 16, 1) if layout is VllmLayout.NHD else (4 * 4 * 16, 4 * 16, 16, 1)
        )
        view = np.lib.stride_tricks.as_strided(cache, (3, 4, 4, 16), tuple(4 * s for s in strides))
        k, v = mem.buffers[(0, "k")], mem.buffers[(0, "v")]
        for b, h, n in [(0, 0, 0), (2, 3, 1), (1, 2, 3)]:
            for buf, half in ((k, 0), (v, 8)):
                off = (
                    buf.offset
                    + b * buf.stride("page")
                    + h * buf.stride("unit")
                    + n * buf.stride("token")
                )
                assert cache[off // 4] == view[b, h, n, half], (layout, b, h, n, buf)


def test_what_vllm_cannot_hold_is_refused_clearly() -> None:
    mla = CacheSpec("mla", (mla_layer(16, 4, DType.BFLOAT16),))
    with pytest.raises(LayoutError, match="attention, Mamba2 and gated-delta-net layers only"):
        vllm_memory(mla, 1, num_blocks=4, block_size=16, layout=VllmLayout.CPU)
    sliding_latent = CacheSpec("dots3-like", (mla_layer(16, 4, DType.BFLOAT16, window=8),))
    with pytest.raises(LayoutError, match=r"caching \['latent'\] \(a sliding MLA latent\)"):
        vllm_memory(sliding_latent, 1, num_blocks=4, block_size=16, layout=VllmLayout.CPU)
    odd = CacheSpec("odd", (attention_layer(2, 8, DType.BFLOAT16, v_head_dim=16),))
    with pytest.raises(LayoutError, match="head size"):
        vllm_memory(odd, 1, num_blocks=4, block_size=16, layout=VllmLayout.NHD)
    with pytest.raises(LayoutError, match="distinct layer names"):
        vllm_memory(
            SPEC, 1, num_blocks=4, block_size=16, layout=VllmLayout.NHD, layer_names=["a", "a", "b"]
        )


# ---- hybrids: vLLM's hybrid allocator (docs/notes-vllm-connector.md, section 10) --------------

HYBRID = CacheSpec(
    "tiny-nemotron-h",
    (
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=DType.FLOAT32, ssm_dtype=DType.FLOAT32),
        attention_layer(2, 8, DType.FLOAT32),
    ),
)
GDN_HYBRID = CacheSpec(
    "tiny-qwen3-next",
    (
        gdn_layer(2, 4, 8, 8, 4, conv_dtype=DType.BFLOAT16, state_dtype=DType.FLOAT32),
        attention_layer(2, 8, DType.BFLOAT16),
    ),
)


def hybrid_side(
    tp: int, block: int, conv: ConvLayout, blocks: int = 24, spec: CacheSpec = HYBRID
) -> Side:
    """Both layers in one allocation, blocks padded to one size; group g0 the Mamba or GDN
    state (one block a request), g1 the attention pages."""
    page = max(
        state_bytes(spec.layers[0], tp),
        vllm_memory(
            CacheSpec("a", spec.layers[1:]),
            tp,
            num_blocks=1,
            block_size=block,
            layout=VllmLayout.CPU,
        )
        .regions[0]
        .nbytes,
    )
    mem = vllm_memory(
        spec,
        tp,
        num_blocks=blocks,
        block_size=block,
        layout=VllmLayout.CPU,
        regions=["A", "A"],
        groups=["g0", "g1"],
        block_bytes=[page, page],
        conv=conv,
    )
    return Side(spec, ParallelLayout.even(2, tp), mem)


@pytest.mark.parametrize("spec", [HYBRID, GDN_HYBRID], ids=["mamba2", "gdn"])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("conv", list(ConvLayout))
def test_a_hybrid_in_one_allocation_matches_the_reference(
    tp_p: int, tp_d: int, conv: ConvLayout, spec: CacheSpec
) -> None:
    n = 37
    src = Placement(n, {"g1": np.array([4, 9, 2])}, {"g0": 7, "aux": 0})
    dst = Placement(n, {"g1": np.array([11, 3, 5])}, {"g0": 8, "aux": 3})
    check_bytes(
        hybrid_side(tp_p, 16, conv, spec=spec),
        hybrid_side(tp_d, 16, ConvLayout.SD, spec=spec),
        src,
        dst,
    )


def test_a_hybrid_block_that_cannot_hold_its_state_or_mixed_sizes_are_refused() -> None:
    small = state_bytes(HYBRID.layers[0], 1) - 4
    with pytest.raises(LayoutError, match="cannot hold"):
        vllm_memory(
            HYBRID,
            1,
            num_blocks=4,
            block_size=16,
            layout=VllmLayout.CPU,
            regions=["A", "B"],
            block_bytes=[small, 4096],
        )
    with pytest.raises(LayoutError, match="one block size"):
        vllm_memory(
            HYBRID,
            1,
            num_blocks=4,
            block_size=16,
            layout=VllmLayout.CPU,
            regions=["A", "A"],
            block_bytes=[8192, 4096],
        )
