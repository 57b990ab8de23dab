"""What the vLLM connector makes of a worker's KV tensors and KV cache groups
(kvbridge.integrations.vllm.describe), on tensors shaped and shared as vLLM 0.32's CPU build
allocates them (docs/notes-vllm-connector.md, sections 6 and 10), without vLLM."""

from __future__ import annotations

import pytest

from kvbridge.errors import LayoutError
from kvbridge.integrations.vllm.describe import KVGroup, StatePart, WorkerPlace, describe
from kvbridge.integrations.vllm.memory import VllmLayout
from kvbridge.integrations.vllm.worker import tail_blocks
from kvbridge.model.spec import DType, LayerKind

torch = pytest.importorskip("torch", reason="the demo extra installs torch")

BLOCKS, PAGE = 16, 65536
# Nemotron-H's Mamba2 layer below at TP 1, as vLLM allocates it in float32: conv 3 x 320, then
# SSM 8 x 32 x 16 (20,224 bytes).
F32_STATES = (StatePart(3 * 320, DType.FLOAT32), StatePart(8 * 32 * 16, DType.FLOAT32))
NEMOTRON_H = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "hidden_size": 128,
    "layers_block_type": ["mamba", "mlp", "attention", "mlp"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "ssm_state_size": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "n_groups": 2,
    "conv_kernel": 4,
    "expand": 2,
    "mamba_ssm_cache_dtype": "float32",
    "torch_dtype": "float32",
}


def place(
    groups: tuple[KVGroup, ...], layers: int, hf: dict[str, object] | None = None
) -> WorkerPlace:
    return WorkerPlace("m", 2, layers, 1, 0, ((0, layers),), 0, "e", True, groups, hf)


def test_a_mamba2_hybrid_shares_one_allocation_and_keeps_a_state_block_a_request() -> None:
    buf = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    mamba = buf.view(BLOCKS, 1, 1, PAGE)[..., :20224]  # conv 3x320 f32, then ssm 8x32x16 f32
    attn = buf.view(torch.float32).view(BLOCKS, 2, 128, 64)
    kv = {"model.layers.0.mixer": mamba, "model.layers.2.mixer.attn": attn}
    groups = (
        KVGroup(("model.layers.0.mixer",), True, F32_STATES),
        KVGroup(("model.layers.2.mixer.attn",), False),
    )
    d = describe(kv, place(groups, 4, NEMOTRON_H), None, aux_slots=4)
    assert [layer.kind for layer in d.spec.layers] == [LayerKind.MAMBA2, LayerKind.FULL]
    assert d.layers == {"model.layers.0.mixer": 0, "model.layers.2.mixer.attn": 1}
    assert d.groups == (("g0", True), ("g1", False)) and d.pp_ranges == ((0, 2),)
    assert [(name, ptr, n) for name, ptr, n in d.regions] == [("L0", buf.data_ptr(), BLOCKS * PAGE)]
    conv, ssm, k = (d.memory.buffers[key] for key in ((0, "conv"), (0, "ssm"), (1, "k")))
    assert (conv.region, conv.offset, conv.stride("slot"), conv.group) == ("L0", 0, PAGE, "g0")
    assert (ssm.offset, ssm.size("elem"), ssm.stride("slot")) == (3840, 8 * 32 * 16, PAGE)
    assert (k.region, k.stride("page"), k.group, d.block_size) == ("L0", PAGE, "g1", 128)


def test_a_state_size_that_differs_from_vllms_is_refused_naming_both() -> None:
    buf = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    kv = {
        "model.layers.0.mixer": buf.view(BLOCKS, 1, 1, PAGE),
        "model.layers.2.mixer.attn": buf.view(torch.float32).view(BLOCKS, 2, 128, 64),
    }
    groups = (
        KVGroup(("model.layers.0.mixer",), True, (F32_STATES[0], StatePart(4000, DType.FLOAT32))),
        KVGroup(("model.layers.2.mixer.attn",), False),
    )
    with pytest.raises(
        LayoutError, match=r"vLLM keeps 19840 bytes .*\[960, 4000\].* makes 20224 .*\[960, 4096\]"
    ):
        describe(kv, place(groups, 4, NEMOTRON_H), None, aux_slots=4)


def test_each_state_takes_the_dtype_vllm_stores_it_in_not_the_configs() -> None:
    # The config says float32 SSM state; this vLLM keeps conv and SSM in bf16 (as a vLLM venv
    # resolved beside another transformers release did for a GDN model): the description
    # follows vLLM, so the bytes it moves are the bytes vLLM holds.
    buf = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    kv = {
        "model.layers.0.mixer": buf.view(BLOCKS, 1, 1, PAGE)[..., :10112],
        "model.layers.2.mixer.attn": buf.view(torch.float32).view(BLOCKS, 2, 128, 64),
    }
    bf16 = tuple(StatePart(p.elements, DType.BFLOAT16) for p in F32_STATES)
    groups = (
        KVGroup(("model.layers.0.mixer",), True, bf16),
        KVGroup(("model.layers.2.mixer.attn",), False),
    )
    d = describe(kv, place(groups, 4, NEMOTRON_H), None, aux_slots=4)
    conv, ssm = d.spec.layers[0].components
    assert (conv.dtype, ssm.dtype) == (DType.BFLOAT16, DType.BFLOAT16)
    assert d.spec.layers[1].component("k").dtype is DType.FLOAT32  # attention as vLLM's tensor
    ssm_buf = d.memory.buffers[(0, "ssm")]
    assert (ssm_buf.offset, ssm_buf.size("elem") * ssm_buf.stride("elem")) == (1920, 8192)


def test_sliding_window_layers_use_their_own_block_table_and_window() -> None:
    full = torch.zeros(BLOCKS, 2, 32, 64)
    swa = torch.zeros(BLOCKS, 2, 32, 64)
    kv = {"model.layers.0.self_attn.attn": full, "model.layers.1.self_attn.attn": swa}
    groups = (
        KVGroup(("model.layers.0.self_attn.attn",), False),
        KVGroup(("model.layers.1.self_attn.attn",), False, window=48),
    )
    d = describe(kv, place(groups, 2), VllmLayout.CPU, aux_slots=4)
    assert [(layer.kind, layer.window) for layer in d.spec.layers] == [
        (LayerKind.FULL, None),
        (LayerKind.SLIDING, 48),
    ]
    assert [d.memory.buffers[(i, "k")].group for i in range(2)] == ["g0", "g1"]
    assert {name for name, _, _ in d.regions} == {"L0", "L1"}


def test_what_the_connector_cannot_serve_yet_is_refused_at_registration() -> None:
    buf = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    attn = buf.view(torch.float32).view(BLOCKS, 2, 128, 64)
    mamba = buf.view(BLOCKS, 1, 1, PAGE)
    kv = {"model.layers.0.mixer": mamba, "model.layers.2.mixer.attn": attn}
    # Speculative decoding: the request's state is not its last Mamba block.
    spec_groups = (
        KVGroup(("model.layers.0.mixer",), True, F32_STATES, speculative_blocks=1),
        KVGroup(("model.layers.2.mixer.attn",), False),
    )
    with pytest.raises(LayoutError, match="speculative decoding"):
        describe(kv, place(spec_groups, 4, NEMOTRON_H), None, aux_slots=4)
    # Several groups under PP: each stage sees its own layers' groups only.
    two = (
        KVGroup(("model.layers.0.self_attn.attn",), False),
        KVGroup(("model.layers.1.self_attn.attn",), False, window=48),
    )
    pp = WorkerPlace("m", 2, 2, 1, 0, ((0, 1), (1, 2)), 0, "e", True, two)
    with pytest.raises(LayoutError, match="--disable-hybrid-kv-cache-manager"):
        describe(
            {"model.layers.0.self_attn.attn": torch.zeros(BLOCKS, 2, 32, 64)},
            pp,
            VllmLayout.CPU,
            aux_slots=4,
        )
    # Layer indices that collide (an MTP layer beside the model's own).
    groups = (
        KVGroup(("model.layers.0.mixer",), True, F32_STATES),
        KVGroup(("model.layers.2.mixer.attn", "mtp.layers.0.attn"), False),
    )
    with pytest.raises(LayoutError, match="collide"):
        describe({**kv, "mtp.layers.0.attn": attn}, place(groups, 4, NEMOTRON_H), None, aux_slots=4)
    # Chunked local attention (Llama 4): vLLM frees the blocks before the current chunk.
    local = (
        KVGroup(("model.layers.0.self_attn.attn",), False, chunk=8192),
        KVGroup(("model.layers.3.self_attn.attn",), False),
    )
    layers = {n: torch.zeros(BLOCKS, 2, 32, 64) for g in local for n in g.layers}
    with pytest.raises(LayoutError, match="chunked local attention"):
        describe(layers, place(local, 4), VllmLayout.CPU, aux_slots=4)


def test_a_load_clears_the_stale_rest_of_its_last_attention_block_and_nothing_else() -> None:
    # The stale bytes vLLM leaves in a loaded block: NaNs, as a bf16 view of a former state
    # block held (docs/notes-vllm-connector.md, section 11).
    buf = torch.full((BLOCKS * PAGE // 4,), float("nan"))
    mamba = buf.view(torch.int8).view(BLOCKS, 1, 1, PAGE)[..., :20224]
    attn = buf.view(BLOCKS, 2, 128, 64)
    kv = {"model.layers.0.mixer": mamba, "model.layers.2.mixer.attn": attn}
    groups = (
        KVGroup(("model.layers.0.mixer",), True, F32_STATES),
        KVGroup(("model.layers.2.mixer.attn",), False),
    )
    d = describe(kv, place(groups, 4, NEMOTRON_H), None, aux_slots=4)
    assert d.block_size == 128 and d.pages == ((), (attn,))
    assert tail_blocks(256, d.block_size, d.pages, ((3,), (5, 6))) == []  # whole blocks
    for t, b in tail_blocks(135, d.block_size, d.pages, ((3,), (5, 6))):
        t[b].zero_()
    assert bool((attn[6] == 0).all())  # the last block, 7 of its 128 rows loaded
    assert bool(attn[5].isnan().all()) and bool(buf.view(BLOCKS, -1)[3].isnan().all())
    # A load starting inside its last block: the rows before its start are held (a prefix
    # hit) and stay; one starting at that block's first row clears it.
    assert tail_blocks(135, d.block_size, d.pages, ((3,), (5, 6)), start=130) == []
    assert len(tail_blocks(135, d.block_size, d.pages, ((3,), (5, 6)), start=128)) == 1
    with pytest.raises(ValueError):  # one block table per group, or nothing is cleared
        tail_blocks(135, d.block_size, d.pages, ((5, 6),))
