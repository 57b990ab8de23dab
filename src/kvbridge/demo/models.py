"""The demo's models: tiny configs of real architectures, and building them.

Every case is a real ``transformers`` architecture built from a small config with random weights
from a fixed seed (float32, eager attention, byte-level vocabulary of 256, ``initializer_range``
0.2: at HF's default 0.02, and still at 0.1 for some of these sizes, greedy text degenerates
into one repeated token; untied embeddings, without which Gemma's text is not varied either).

The CacheSpec of each model's HF cache is :mod:`kvbridge.demo.cachemap`'s.

This module imports torch and transformers only inside the functions that need them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.demo import hfconfig
from kvbridge.errors import SpecError

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "initializer_range": 0.2,
    "dtype": "float32",
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class ModelCase:
    name: str
    title: str  # architecture, for people
    model_type: str  # the HF model_type
    config: Mapping[str, Any]
    topologies: tuple[tuple[str, str], ...]  # the default matrix: (topology, transport)
    # HF's Mamba1 (without its CUDA kernels) starts each multi-token forward from a zero SSM
    # state, so a chunked prefill is wrong: such a model prefills its prompt in one forward
    # (UNCHUNKED: Jamba's Mamba1 layers too, measured: last logits 3e-3 apart).
    chunked: bool = True
    full_size: bool = False  # a user's config at its real dimensions (no size check)
    # A model directory whose weights every process loads (else random weights from the seed),
    # and its tokenizer.json (else the prompt's bytes are its tokens).
    weights: str = ""
    tokenizer: str = ""

    def __post_init__(self) -> None:
        if self.weights and not self.full_size:
            raise SpecError(f"{self.name}: real weights are served at full size only")
        if self.tokenizer and not self.weights:
            raise SpecError(f"{self.name}: a tokenizer comes with real weights only")


UNCHUNKED = ("mamba", "falcon_mamba", "jamba")  # model types whose prefill is one forward

CASES: dict[str, ModelCase] = {
    c.name: c
    for c in (
        ModelCase(
            "llama",
            "Llama (dense GQA, 6 KV heads)",
            "llama",
            {
                "hidden_size": 96,
                "intermediate_size": 192,
                "num_hidden_layers": 2,
                "num_attention_heads": 12,
                "num_key_value_heads": 6,
                "head_dim": 16,
            },
            (("tp2-tp3", "shm"), ("page64-16", "tcp"), ("pp2-pp1", "shm")),
        ),
        ModelCase(
            "qwen3",
            "Qwen3 (dense GQA, 2 KV heads: replicated at TP4)",
            "qwen3",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
            },
            (("tp4-tp1", "shm"), ("tp1-tp4", "shm"), ("nhd-hnd", "tcp"), ("cp2-tp2", "tcp")),
        ),
        ModelCase(
            "deepseek-v3",
            "DeepSeek-V3 (MLA latent, MoE)",
            "deepseek_v3",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "kv_lora_rank": 32,
                "q_lora_rank": 48,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
            },
            (
                ("tp4-tp1", "shm"),
                ("tp2-tp3", "tcp"),
                ("pp2-pp1", "shm"),
                ("dp2-dp2", "tcp"),
                ("tp1-dcp2", "shm"),
            ),
        ),
        ModelCase(
            "qwen3-next",
            "Qwen3-Next (gated delta net + attention, MoE)",
            "qwen3_next",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
            },
            (("tp1-tp4", "shm"), ("tp4-tp1", "tcp"), ("pp2-pp1", "shm"), ("cp2xtp2-tp1", "shm")),
        ),
        ModelCase(
            "bamba",
            "Bamba (Mamba2 + attention)",
            "bamba",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "attn_layer_indices": [1],
                "mamba_n_heads": 4,
                "mamba_d_head": 32,
                "mamba_n_groups": 2,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
            },
            (("tp4-tp1", "shm"), ("tp1-tp4", "tcp"), ("pp2-pp1", "shm")),
        ),
        ModelCase(
            "gemma3",
            "Gemma 3 (sliding window 16 + global)",
            "gemma3_text",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "sliding_window": 16,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            },
            (("tp4-tp1", "shm"), ("page64-16", "shm"), ("nhd-hnd", "tcp")),
        ),
        ModelCase(
            "gpt-oss",
            "gpt-oss (sliding window 16 / full, sinks, MoE)",
            "gpt_oss",
            {
                "hidden_size": 64,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "sliding_window": 16,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
            },
            (("tp2-tp1", "shm"),),
        ),
        ModelCase(
            "nemotron-h",
            "Nemotron-H (Mamba2, attention, MLP-only layers)",
            "nemotron_h",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "hybrid_override_pattern": "M-*-M",
                "mamba_num_heads": 4,
                "mamba_head_dim": 32,
                "n_groups": 2,
                "ssm_state_size": 16,
                "conv_kernel": 4,
                "expand": 2,
            },
            (("tp1-tp2", "shm"),),
        ),
        ModelCase(
            "falcon-h1",
            "Falcon-H1 (attention and Mamba2 in every layer)",
            "falcon_h1",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "mamba_n_heads": 4,
                "mamba_d_head": 32,
                "mamba_n_groups": 2,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_d_ssm": 128,
            },
            (("tp2-tp1", "tcp"),),
        ),
        ModelCase(
            "mamba",
            "Mamba (Mamba1: conv and SSM state by channel)",
            "mamba",
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "state_size": 16,
                "expand": 2,
                "conv_kernel": 4,
                "time_step_rank": 8,
            },
            (("tp1-tp4", "shm"), ("tp2-tp1", "tcp")),
            chunked=False,
        ),
        ModelCase(
            "lfm2",
            "LFM2 (gated short convolutions + attention)",
            "lfm2",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "conv_L_cache": 3,
                "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            },
            (("tp1-tp4", "shm"), ("tp2-tp1", "tcp")),
        ),
        ModelCase(
            "deepseek-v3.2",
            "DeepSeek-V3.2 (MLA latent + sparse-attention indexer keys)",
            "deepseek_v32",
            {
                "hidden_size": 64,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "kv_lora_rank": 32,
                "q_lora_rank": 48,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8,
                "v_head_dim": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "index_head_dim": 32,
                "index_n_heads": 4,
                "index_topk": 8,
            },
            (("tp4-tp1", "shm"), ("tp1-tp2", "tcp")),
        ),
    )
}


def get_case(name: ModelCase | str) -> ModelCase:
    if isinstance(name, ModelCase):
        return name
    try:
        return CASES[name]
    except KeyError:
        raise SpecError(f"unknown demo model {name!r}; known: {', '.join(CASES)}") from None


# ---- building a model ---------------------------------------------------------------------------


def preload() -> None:
    """Import every case's modeling module now (transformers imports them lazily, which costs
    each new process seconds): the fork server calls this once, before any rank is forked."""
    import importlib

    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.utils import logging

    logging.set_verbosity_error()  # not one "falling back to the PyTorch kernel" line per rank
    logging.disable_progress_bar()  # nor a "Loading weights" bar per rank

    for case in CASES.values():
        module = model_type_to_module_name(case.model_type)
        importlib.import_module(f"transformers.models.{module}.configuration_{module}")
        importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def hf_config(case: ModelCase) -> Any:
    """The case's transformers config; SpecError, with transformers' reason in one line, where
    the class refuses its fields (the demo's size breaks a constraint of the class)."""
    from huggingface_hub.errors import StrictDataclassError

    # Real weights come with their own vocabulary and tied embeddings; float32 either way.
    common = {"dtype": "float32"} if case.weights else _COMMON
    try:
        config = hfconfig.for_model(case.model_type, **{**common, **case.config})
    except (StrictDataclassError, ValueError, TypeError) as e:
        raise SpecError(f"{case.name}: transformers refuses the config: {one_line(e)}") from None
    config._attn_implementation = "eager"
    return config


def tokenizer(case: ModelCase) -> Any:
    """The case's tokenizer (``tokenizers``: transformers' own dependency, which imports no
    torch); SpecError where its file does not read as one."""
    return _tokenizer_at(case.tokenizer)


@functools.lru_cache(maxsize=4)
def _tokenizer_at(path: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the Rust library's errors have no common type
        raise SpecError(f"{path}: not a tokenizer the tokenizers library reads: {e}") from None


def one_line(e: BaseException) -> str:
    """An error's message on one line: its first line, and the next where the first only
    introduces it (transformers' validation errors: "... validator 'x':" then the reason)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text[:300]


def build_model(case: ModelCase, seed: int) -> Any:
    """The model in eval mode, its weights drawn from ``seed`` (the same in every process),
    or loaded from the case's model directory."""
    import torch

    if case.weights:
        model = _loaded(case).eval()
    else:
        if not case.full_size:  # weighed first, without memory: a field left at full size
            weigh(case)
        torch.manual_seed(seed)
        model = _built(
            case,
            lambda: _from_config(hf_config(case), attn_implementation="eager", dtype=torch.float32),
        ).eval()
    rescale = getattr(model.base_model, "_rescale_layers", None)
    if rescale is not None:  # RWKV rescales its weights at its first forward in eval mode:
        rescale()  # now, so that every process hashes the weights every forward uses
    return model


def _loaded(case: ModelCase) -> Any:
    """The model with the weights of its directory, as float32; SpecError, in one line, where
    they do not fit the config or leave a parameter out (transformers would draw it at random,
    and each process would serve a different model)."""
    import torch

    model, info = _built(
        case,
        lambda: causal_lm(hf_config(case)).from_pretrained(
            case.weights,
            config=hf_config(case),
            attn_implementation="eager",
            dtype=torch.float32,
            output_loading_info=True,
        ),
    )
    # (a tensor of the wrong shape makes transformers raise: _built says so in one line)
    names = sorted(map(str, info.get("missing_keys", ())))
    if names:
        raise SpecError(
            f"{case.name}: the weights in {case.weights} lack {len(names)} parameter(s) of "
            f"the model ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        )
    return model


def on_meta(case: ModelCase) -> Any:
    """The model built on the meta device (no memory, no weights); SpecError, in one line,
    where transformers cannot build it."""
    import torch

    with torch.device("meta"):
        return _built(case, lambda: _from_config(hf_config(case), dtype=torch.float32))


def weigh(case: ModelCase) -> None:
    """SpecError, in one line, where transformers cannot build the model (:func:`on_meta`),
    or where it is still large once scaled (a field of its family the demo does not scale,
    named by the largest parameter)."""
    model = on_meta(case)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    if total > MAX_PARAMS:
        name, big = max(params.items(), key=lambda kv: kv[1].numel())
        raise SpecError(
            f"{case.name}: scaled down, the model still has {total / 1e6:.0f}M parameters "
            f"({name}: {tuple(big.shape)}): a field of {case.model_type} the demo does not "
            f"scale; --full-size builds it as it is"
        )


def causal_lm(config: Any) -> Any:
    """AutoModelForCausalLM, knowing ``config``'s class: for a multimodal model's text config
    it does not map (Mllama's, Emu3's), the one causal LM of the config's own modeling module
    built from that config class is registered with it (ValueError where there is none)."""
    import importlib

    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        module = importlib.import_module(
            type(config).__module__.replace(".configuration_", ".modeling_")
        )
        own = [
            cls
            for name, cls in vars(module).items()
            if name.endswith("ForCausalLM") and getattr(cls, "config_class", None) is type(config)
        ]
        if len(own) != 1:
            raise ValueError(f"Unrecognized configuration class {type(config)} for a causal LM")
        AutoModelForCausalLM.register(type(config), own[0], exist_ok=True)
    return AutoModelForCausalLM


def _from_config(config: Any, **kwargs: Any) -> Any:
    return causal_lm(config).from_config(config, **kwargs)


def _built(case: ModelCase, build: Any) -> Any:
    """``build()``: transformers building ``case``'s model, its failures as SpecErrors."""
    try:
        return build()
    except SpecError:
        raise
    except ValueError as e:  # not a causal LM (an encoder, a vision model...)
        raise SpecError(
            f"{case.name}: transformers builds no causal LM from a "
            f"{case.model_type} config: {str(e).splitlines()[0]}"
        ) from None
    except Exception as e:  # noqa: BLE001 - the class's own constructor fails on this config
        raise SpecError(
            f"{case.name}: transformers' own model fails to build from this config: "
            f"{type(e).__name__}: {one_line(e)}"
        ) from None


MAX_PARAMS = 64_000_000  # the scaled models are under a few million parameters


def weights_digest(model: Any) -> str:
    """A hash of every parameter and buffer: every process checks it builds the same model."""
    import torch

    h = hashlib.sha256()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.encode())
        # as bytes: numpy has no bfloat16 (RecurrentGemma keeps a bfloat16 buffer)
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
