"""Issue 33, users' models: the architectures the sweep refused for kvbridge's own gaps.

GLM-4.5's class defaults (96 heads of hidden / heads over 46 layers) scaled small enough to
run; CPM-Ant's MLP and head sizes scaled, and its learned prompt positions (cached before the
request's tokens) a PREFIX layer; Hy-V4's "shared" indexer layers described as the
MLA layers they cache; Inkling's four short convolutions a layer described as a SHORT_CONV
layer beside its attention, sharded as a tensor-parallel engine holds them; ZAYA's CCA (its
q|k convolution by head, its delayed value replicated) a SHORT_CONV layer beside its
attention; DeepSeek-V4's compressed attention (one KV entry every few tokens) a SLIDING
layer and a COMPRESSED one; XLNet's memory (each layer's input hidden states) a layer of one
replicated component; BLT refused for transformers' own cache, which its config does not build.
Each through the whole path in one process (:func:`kvbridge.demo.sweep.check`)
where it runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the demo needs torch: pip install -e '.[demo]'")
pytest.importorskip("transformers", reason="the demo needs transformers: pip install -e '.[demo]'")

from kvbridge.demo import forward, sweep  # noqa: E402
from kvbridge.demo.cache_io import snapshot  # noqa: E402
from kvbridge.demo.cachemap import cache_map  # noqa: E402
from kvbridge.demo.configs import case_from_raw  # noqa: E402
from kvbridge.demo.matrix import check_topology  # noqa: E402
from kvbridge.demo.models import MAX_PARAMS, build_model, weigh  # noqa: E402
from kvbridge.errors import IncompatibleError, SpecError  # noqa: E402
from kvbridge.model.spec import DType, LayerKind  # noqa: E402
from kvbridge.model.states import attention_convs_layer, cca_layer  # noqa: E402
from kvbridge.planner.reference import local_bytes  # noqa: E402


def _cut(model_type: str, layers: int) -> dict[str, Any]:
    """The class defaults of ``model_type`` with their first ``layers`` layers (every list
    that names the layers one by one cut with the count)."""
    config = sweep.saved_defaults(model_type)
    n = config["num_hidden_layers"]
    cut = {k: v[:layers] for k, v in config.items() if isinstance(v, list) and len(v) == n}
    return {**config, **cut, "num_hidden_layers": layers}


def _params(case: Any) -> int:
    from transformers import AutoModelForCausalLM

    from kvbridge.demo.models import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(case))
    return sum(p.numel() for p in model.parameters())


# ---- sizes the demo did not scale ----------------------------------------------------------


def test_glm4_moes_96_heads_keep_their_count_at_a_size_the_demo_builds() -> None:
    """96 heads of hidden / heads (no head_dim in GLM-4.5's class defaults) at 8 a head over
    46 layers were still 76M parameters: past 64 heads a head is 4 wide, the heads stay 96."""
    case = case_from_raw(sweep.saved_defaults("glm4_moe"), "glm4_moe", "glm4_moe")
    assert case.config["num_attention_heads"] == 96
    assert case.config["hidden_size"] == 96 * 4
    weigh(case)  # SpecError past MAX_PARAMS
    assert _params(case) < MAX_PARAMS // 2
    full = cache_map(case).spec.layers[0]
    assert full.kind is LayerKind.FULL
    assert [(s.units, s.unit_size) for s in full.components[0].segments] == [(8, 4)]


@pytest.mark.slow  # some 4 s of CPU here: past the fast tier's budget
def test_cpmants_prompt_positions_travel_as_a_prefix_layer_and_run_exact() -> None:
    """CPM-Ant's ``dim_ff`` (10240) and ``dim_head`` (128) are scaled like the MLP widths and
    head dims of other families. Every layer caches ``prompt_length`` learned positions before
    the request's tokens (their keys and values the request's: its attention is bidirectional
    over the first forward's input): a PREFIX layer, then the FULL layer of the tokens."""
    case = case_from_raw(sweep.saved_defaults("cpmant"), "cpmant", "cpmant")
    assert (case.config["dim_ff"], case.config["dim_head"]) == (64, 16)
    weigh(case)
    assert _params(case) < MAX_PARAMS // 2
    prompt, heads = case.config["prompt_length"], case.config["num_attention_heads"]
    cmap = cache_map(case)
    assert [la.kind for la in cmap.spec.layers[:2]] == [LayerKind.PREFIX, LayerKind.FULL]
    k = cmap.spec.layers[0].component("k")
    assert (k.rows, [(s.units, s.unit_size) for s in k.segments]) == (prompt, [(heads, 16)])
    assert sweep.check("cpmant", "defaults", sweep.saved_defaults("cpmant")).outcome is (
        sweep.Outcome.EXACT
    )
    # What transformers' model does: 5 tokens, 32 + 5 positions cached; and a step's input is
    # the whole sequence, of which only the tokens past the cache count beyond being nonzero
    # (the decode's fillers): the same logits as the real tokens give.
    small = case_from_raw(_cut("cpmant", 2), "cpmant", "cpmant")
    model = build_model(small, 1)
    logits = []
    for seen in (list(b"hello"), [forward.filler(model)] * 5):
        *_, (_, _, first, cache) = forward.prefill_steps(model, tuple(b"hello"), 5)
        assert cache.layers[0].keys.shape[2] == prompt + 5
        with torch.no_grad():
            step = model(torch.tensor([[*seen, first]]), past_key_values=cache, use_cache=True)
        logits.append(step.logits[0, -1])
    assert torch.equal(*logits)


def test_a_causal_xlm_runs_exact_and_a_masked_one_is_refused_for_transformers_own_failure() -> None:
    """XLM takes its cache as ``cache`` and the whole sequence at every step (keeping what is
    past the cache; the decode gives fillers, not its padding, for the rest). A causal XLM (the
    CLM checkpoints) runs exact; the default, a masked LM attending both ways, transformers
    itself cannot continue from a cache (its padding mask keeps the whole length)."""
    causal = {**sweep.saved_defaults("xlm"), "causal": True}
    assert sweep.check("xlm", "causal", causal).outcome is sweep.Outcome.EXACT
    got = sweep.check("xlm", "defaults", sweep.saved_defaults("xlm"))
    assert got.outcome is sweep.Outcome.REFUSED, got
    assert "transformers' own forward fails" in got.detail, got
    model = build_model(case_from_raw(causal, "xlm", "xlm"), 1)
    assert forward.filler(model) != model.config.pad_index


# ---- Hy-V4: indexer layers that share the last full layer's top-k ------------------------


def test_hy_v4s_shared_indexer_layers_are_mla_without_indexer_keys() -> None:
    """A "shared" layer reuses the previous full layer's top-k and never writes its cache
    layer's indexer keys: described as MLA (the latent only), the full ones as MLA_INDEXER."""
    config = sweep.saved_defaults("hy_v4")
    case = case_from_raw(config, "hy_v4", "hy_v4")
    kinds = [layer.kind for layer in cache_map(case).spec.layers]
    want = {"full": LayerKind.MLA_INDEXER, "shared": LayerKind.MLA}
    assert kinds == [want[t] for t in config["indexer_types"]]
    assert {LayerKind.MLA, LayerKind.MLA_INDEXER} <= set(kinds)


@pytest.mark.slow  # 6 of its layers through the whole path: some 5 s
def test_hy_v4_runs_exact_with_its_shared_indexer_layers() -> None:
    config = _cut("hy_v4", 6)  # full, full, shared, shared, shared, full
    assert "shared" in config["indexer_types"]
    got = sweep.check("hy_v4", "6 layers", config)
    assert got.outcome is sweep.Outcome.EXACT, got
    assert got.kinds == ("mla_indexer", "mla")


# ---- Inkling: four short convolutions around each attention layer -----------------------


def test_inklings_convs_shard_by_kv_head_and_replicate_the_residual_stream() -> None:
    """At TP 2, rank 1 holds the second half of the KV heads' channels of ``k`` and ``v``
    (as it holds those heads' keys and values) and the whole residual stream of ``attn`` and
    ``mlp`` (every rank holds the layer's reduced output)."""
    layer = attention_convs_layer(4, 2, 6, 4, 3, dtype=DType.FLOAT32)
    assert layer.kind is LayerKind.SHORT_CONV
    assert [(c.name, c.rows) for c in layer.components] == [
        ("k", 3),
        ("v", 3),
        ("attn", 2),
        ("mlp", 2),
    ]
    k, _, attn, _ = layer.components
    row = np.arange(4 * 2 * 4)  # one step's bytes: 8 float32 channels
    assert local_bytes(k, 2, 1, row).tolist() == list(range(16, 32))
    row = np.arange(6 * 4)
    assert local_bytes(attn, 2, 1, row).tolist() == list(range(24))


@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text"])
def test_each_inkling_layer_is_its_attention_then_its_four_convs(model_type: str) -> None:
    """Sliding layers' convs over their own (``swa_``) KV heads, the full layers' over theirs."""
    config = sweep.saved_defaults(model_type)
    spec = cache_map(case_from_raw(config, model_type, model_type)).spec
    assert len(spec.layers) == 2 * config["num_hidden_layers"]
    for i, t in enumerate(config["layer_types"]):
        attention, convs = spec.layers[2 * i], spec.layers[2 * i + 1]
        assert attention.kind is {"hybrid": LayerKind.FULL, "hybrid_sliding": LayerKind.SLIDING}[t]
        assert convs.kind is LayerKind.SHORT_CONV
        kv = "swa_num_key_value_heads" if t == "hybrid_sliding" else "num_key_value_heads"
        assert attention.components[0].segments[0].units == config[kv]
        assert convs.components[0].segments == attention.components[0].segments


@pytest.mark.slow  # 6 of their layers through the whole path: some 10 s each
@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text"])
def test_inkling_runs_exact_and_its_four_conv_states_are_checked(model_type: str) -> None:
    config = _cut(model_type, 6)  # five sliding layers, then a full one
    assert set(config["layer_types"]) == {"hybrid", "hybrid_sliding"}
    got = sweep.check(model_type, "6 layers", config)
    assert got.outcome is sweep.Outcome.EXACT, got
    assert got.kinds == ("sliding", "short_conv", "full")
    # the bitwise check covers every conv state of every layer
    case = case_from_raw(config, model_type, model_type)
    model = build_model(case, sweep.SEED)
    cmap = cache_map(case, model.config)
    *_, (_, _, _, cache) = forward.prefill_steps(model, sweep.PROMPT, 16)
    held = snapshot(cmap, cache)
    for i in range(6):
        assert {f"HF layer {i} conv_states", f"HF layer {i} conv_states[3]"} <= set(held)
        assert np.any(held[f"HF layer {i} conv_states[3]"] != 0)


# ---- ZAYA: compressed convolutional attention (CCA) beside each attention layer ------------


def test_zayas_cca_conv_shards_by_head_and_its_delayed_value_is_replicated() -> None:
    """At TP 2 (8 query heads, 2 KV heads of 2 channels), rank 1 holds query heads 4..7 and
    KV head 1 of each conv step, and the whole delayed value (it is the second half of the
    value channels taken together, no KV head's own)."""
    layer = cca_layer(8, 2, 2, 3, dtype=DType.FLOAT32)
    assert layer.kind is LayerKind.SHORT_CONV
    conv, delayed = layer.components
    assert (conv.name, conv.rows, delayed.name, delayed.rows) == ("conv", 2, "v_delayed", 1)
    row = np.arange((8 + 2) * 2 * 4)  # one step's bytes: 20 float32 channels, q then k
    q, k = list(range(16 * 4)), list(range(16 * 4, 20 * 4))
    assert local_bytes(conv, 2, 1, row).tolist() == q[32:] + k[8:]
    assert local_bytes(conv, 2, 0, row).tolist() == q[:32] + k[:8]
    row = np.arange(2 * 2 // 2 * 4)
    assert local_bytes(delayed, 2, 0, row).tolist() == local_bytes(delayed, 2, 1, row).tolist()
    assert local_bytes(delayed, 2, 1, row).tolist() == list(range(8))


def test_each_zaya_layer_is_its_attention_then_its_cca() -> None:
    """The conv's query and key heads are the attention's (the scaled config's), its steps
    what the two convolutions in a row need: (cca_time0 - 1) + (cca_time1 - 1)."""
    case = case_from_raw(sweep.saved_defaults("zaya"), "zaya", "zaya")
    c = case.config
    cmap = cache_map(case)
    assert len(cmap.spec.layers) == 2 * c["num_hidden_layers"]
    attention, cca = cmap.spec.layers[:2]
    assert (attention.kind, cca.kind) == (LayerKind.FULL, LayerKind.SHORT_CONV)
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    assert attention.components[0].segments[0].units == kv
    conv, delayed = cca.components
    assert [(s.name, s.units, s.unit_size) for s in conv.segments] == [
        ("q", heads, hd),
        ("k", kv, hd),
    ]
    assert conv.rows == c["cca_time0"] - 1 + c["cca_time1"] - 1
    assert delayed.axis_elems == kv * hd // 2
    assert cmap.layers[1].hf_index == cmap.layers[0].hf_index == 0


@pytest.mark.slow  # 4 layers through the whole path: some 5 s
def test_zaya_runs_exact_with_sliding_layers_and_its_cca_state_checked() -> None:
    config = {
        **_cut("zaya", 4),
        "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        "sliding_window": 8,
    }
    got = sweep.check("zaya", "4 layers", config)
    assert got.outcome is sweep.Outcome.EXACT, got
    assert got.kinds == ("sliding", "short_conv", "full")
    # the bitwise check covers the conv and the delayed value of every layer
    case = case_from_raw(config, "zaya", "zaya")
    model = build_model(case, sweep.SEED)
    cmap = cache_map(case, model.config)
    *_, (_, _, _, cache) = forward.prefill_steps(model, sweep.PROMPT, 16)
    held = snapshot(cmap, cache)
    for i in range(4):
        assert np.any(held[f"HF layer {i} conv_states"] != 0)
        assert np.any(held[f"HF layer {i} recurrent_states"] != 0)


# ---- DeepSeek-V4: compressed attention, an entry every few tokens ---------------------------


def test_deepseek_v4s_compressed_attention_travels_and_runs_exact() -> None:
    """Each layer is its sliding window (its keys are its values: one ``kv``) and its
    compressor's: an entry every ``compress_rates`` tokens (scaled to 4 and 8), the unclosed
    window's projections and gates, and for compressed sparse attention the last closed
    window's first series and the indexer's keys, buffers and overlap. What transformers'
    cache holds after 62 tokens (15 entries and 2 buffered in a CSA layer of rate 4, 7 and 6
    in an HCA layer of rate 8) is what the description reads, a state's rows past those held
    zeros; and the whole path is exact."""
    from kvbridge.demo import compressed

    case = case_from_raw(_cut("deepseek_v4", 4), "deepseek_v4", "deepseek_v4")
    rates = case.config["compress_rates"]
    assert rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    cmap = cache_map(case)
    kinds = [layer.kind for layer in cmap.spec.layers]
    assert kinds == [LayerKind.SLIDING, LayerKind.COMPRESSED] * 4
    csa = cmap.spec.layers[7]
    assert [(c.name, c.stride, c.rows) for c in csa.components if c.name.startswith("kv")] == [
        ("kv", 4, 1),
        ("kv_buffer", 1, 3),
        ("kv_buffer_gate", 1, 3),
        ("kv_overlap", 1, 4),
        ("kv_overlap_gate", 1, 4),
    ]
    assert {c.name for c in cmap.spec.layers[1].components} == {
        "kv",
        "kv_buffer",
        "kv_buffer_gate",
    }
    model = build_model(case, 1)
    n = 62
    *_, (_, _, _, cache) = forward.prefill_steps(model, sweep.PROMPT[:n], 16)
    by_type = dict(zip(case.config["layer_types"], cache.layers, strict=False))
    for layer_type, entries, buffered in (
        ("compressed_sparse_attention", 15, 2),
        ("heavily_compressed_attention", 7, 6),
    ):
        layer = by_type[layer_type]
        assert layer.compressed_kv["compressor"].shape[1] == entries
        assert layer.buffer_kv["compressor"].shape[1] == buffered
        assert compressed.counts(layer)["entry_count[compressor]"] == entries
        padded = compressed.tensor(
            layer,
            "kv_buffer",
            rates[layer_type] - 1,
            16 * (2 if layer_type.startswith("compressed") else 1),
        )
        assert torch.equal(padded[:buffered], layer.buffer_kv["compressor"][0])
        assert not padded[buffered:].any()
    got = sweep.check("deepseek_v4", "defaults", _cut("deepseek_v4", 4))
    assert got.outcome is sweep.Outcome.EXACT, got.detail
    # A context-parallel side would split the entries in no way described: refused up front.
    with pytest.raises(IncompatibleError, match=r"cp=2.* keep one entry every few tokens"):
        check_topology(case, "tp=1,cp=2,tokens=zigzag,page=16->tp=2,page=16", cmap.spec)


@pytest.mark.slow  # some 4 s of CPU here: past the fast tier's budget
def test_hrms_cycled_stacks_are_sent_after_the_forward_and_exact() -> None:
    """HRM runs its two stacks in cycles: one decoder layer writes several cache layers, which
    layer-wise sends cannot attribute (it was refused): no layer is hooked, each is read once
    the chunk's forward is done, and the whole path is exact."""
    from kvbridge.demo import hfcache

    case = case_from_raw(sweep.saved_defaults("hrm_text"), "hrm_text", "hrm_text")
    model = build_model(case, 0)
    indices = [hf.hf_index for hf in cache_map(case, model.config).layers]
    hooks = hfcache.LayerHooks(model, indices, range(len(indices)), lambda *_: None)
    assert not hooks.layerwise and "cache has layers [16, 17, 18, 19]" in hooks.why
    got = sweep.check("hrm_text", "defaults", sweep.saved_defaults("hrm_text"))
    assert got.outcome is sweep.Outcome.EXACT, got.detail


@pytest.mark.parametrize("model_type", ["musicgen", "musicgen_melody"])
def test_musicgens_token_is_a_frame_of_every_codebook_and_runs_exact(model_type: str) -> None:
    """MusicGen's decoder reads and predicts a token of each audio codebook a step: the demo's
    token is the frame, the codebooks' ids its digits in base vocab_size. The first sampled
    frame is each codebook head's own greedy choice on the prompt given codebook by codebook
    (built here without the demo's helpers), later frames use the codebooks past the first, and
    the whole path is exact."""
    case = case_from_raw(sweep.saved_defaults(model_type), model_type, model_type)
    model = build_model(case, sweep.SEED)
    books, vocab = model.config.num_codebooks, model.config.vocab_size
    prompt = tuple(b"frames of four codebooks")
    *_, (_, _, first, cache) = forward.prefill_steps(model, prompt, len(prompt))
    ids = torch.zeros(books, len(prompt), dtype=torch.long)
    ids[0] = torch.tensor(prompt)  # bytes are frames of the first codebook alone
    with torch.no_grad():
        logits = model(ids).logits
    assert first == sum(int(logits[k, -1].argmax()) * vocab**k for k in range(books))
    out = forward.decode_steps(model, cache, first, len(prompt), 6)
    assert any(t >= vocab for t in out), out
    got = sweep.check(model_type, "defaults", sweep.saved_defaults(model_type))
    assert got.outcome is sweep.Outcome.EXACT, got


# ---- XLNet: a memory of each layer's input hidden states, returned by its forward ----------


@pytest.mark.slow  # two configs through the whole path: some 10 s
def test_xlnets_memory_is_each_layers_input_hidden_states_replicated_and_runs_exact() -> None:
    """XLNet caches no keys and values: each layer keeps the hidden states its tokens gave it
    (``mems``, the last ``mem_len`` tokens'), every rank the whole residual stream, and its
    forward returns the new memory rather than writing into the one it is given. A SLIDING
    layer of one replicated component (``mem_len`` scaled to 16, so that the demo's prompt
    crosses it), or a HIDDEN layer of all tokens with ``mem_len`` 0; exact both ways, the
    memory being what transformers' hidden states say a layer was given."""
    config = sweep.saved_defaults("xlnet")
    case = case_from_raw(config, "xlnet", "xlnet")
    assert case.config["mem_len"] == 16
    d = case.config["d_model"]
    for layer in cache_map(case).spec.layers:
        assert (layer.kind, layer.window) == (LayerKind.SLIDING, 16)
        (mems,) = layer.components
        assert (mems.name, [(s.units, s.unit_size) for s in mems.segments]) == ("mems", [(1, d)])
    whole = {**config, "mem_len": 0}
    assert {la.kind for la in cache_map(case_from_raw(whole, "xlnet", "xlnet")).spec.layers} == {
        LayerKind.HIDDEN
    }
    for variant, raw in (("defaults", config), ("mem_len 0", whole)):
        got = sweep.check("xlnet", variant, raw)
        assert got.outcome is sweep.Outcome.EXACT, got.detail
    model = build_model(case_from_raw(whole, "xlnet", "xlnet"), 1)
    *_, (_, _, _, cache) = forward.prefill_steps(model, tuple(b"hello"), 5)
    with torch.no_grad():
        states = model(torch.tensor([list(b"hello")]), output_hidden_states=True).hidden_states
    assert len(cache) == model.config.n_layer
    for layer, given in zip(cache, states, strict=False):  # the last hidden state is no input
        assert torch.equal(layer[:, 0], given[0])
    with pytest.raises(SpecError, match="reuse_len=4 keeps the first tokens"):
        cache_map(case_from_raw({**config, "reuse_len": 4}, "xlnet", "xlnet"))


# ---- BLT: transformers builds no cache from its config ---------------------------------------


def test_blt_is_refused_for_transformers_own_cache_which_its_generate_fails_to_build() -> None:
    """BLT keeps its stacks' layer counts in sub-configs, which transformers' cache does not
    read: the refusal names that, before any model is built, and it is what transformers does
    itself with the config: its cached forward fails alike (the model built by the class, as
    the demo would build it, the demo's own code not involved)."""
    from transformers import AutoModelForCausalLM, BltConfig

    for variant, config in sweep.variants("blt"):
        got = sweep.check("blt", variant, config, sweep.Depth.CONFIG)
        assert got.outcome is sweep.Outcome.REFUSED, got
        assert "transformers' own cache fails to build" in got.detail, got
        assert "num_hidden_layers" in got.detail, got
    small = BltConfig(
        vocab_size=260,
        encoder_hash_byte_group_vocab=64,
        patcher_config={"hidden_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4},
        encoder_config={"hidden_size": 32, "num_attention_heads": 4, "hidden_size_global": 64},
        decoder_config={"hidden_size": 32, "num_attention_heads": 4, "hidden_size_global": 64},
        global_config={"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4},
    )
    model = AutoModelForCausalLM.from_config(small).eval()
    ids = torch.tensor([list(b"hello")])
    with torch.no_grad():
        assert model(ids, use_cache=False).logits.shape[1] == 5  # it runs, without a cache
        with pytest.raises(AttributeError, match="num_hidden_layers"):
            model(ids, use_cache=True)
