"""Tiny random models of the seeds' classes for real SGLang servers on CPU: a gated-delta-net
hybrid of the Qwen3-Next class, a Mamba2 hybrid of the Nemotron-H class, a sliding-window hybrid
of the Mellum class (:data:`SWA_ARCH`: SGLang gives it its hybrid ``SWAKVPool``) and an MLA model
of the DeepSeek-V2 class (:data:`MLA_ARCH`: SGLang's ``MLATokenToKVPool``). No download, a few MB
each.

Written by the SGLang venv's transformers (a model saved by another version may carry config
fields SGLang's cannot read), so :func:`make_hybrid_model` runs a subprocess with that python;
inside the venv, :func:`write_hybrid_model` does the work. Each directory holds config.json,
generation_config.json, model.safetensors (float32, fixed seed) and the WordLevel tokenizer of
tests/vllm_model.py (ids 0-3 special, any other id ``i`` the word ``t{i}``).

Serving them needs the stand-in kernels of tests/sglang_standins/ (see its README.md): the venv
scripts/sglang_env.sh builds has them on its path. :data:`HYBRID_ARGS` are the server flags the
hybrids need on top of kvbridge.integrations.sglang.launch's CPU flags.

Shapes are chosen so that TP 2 splits every head count (attention, GDN key and value heads, Mamba2
heads and groups, MoE intermediate), and so that the state pools are small.
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
ARCHS = ("qwen3_next", "nemotron_h")
# Sliding-window attention layers beside full-attention ones: SGLang 0.5.23 keeps the sliding
# layers' KV in a window sub-pool of their own (SWAKVPool). Not in ARCHS: it needs no Mamba
# flags, and tests/test_sglang_swa_pd.py serves it.
SWA_ARCH = "mellum"
# The config's window (transformers': a token sees itself and the 39 before it). SGLang's
# scheduler keeps one less (sliding_window_size = 39 for Mellum) and masks to the same 40.
SWA_WINDOW = 40
# Multi-head latent attention: one latent row a token and layer (kv_lora_rank + rope dims),
# replicated across TP. Not in ARCHS either: tests/test_sglang_mla_pd.py serves it.
MLA_ARCH = "deepseek_v2"

# vllm_model.py's: large enough that greedy decoding has clear margins between the top two
# logits (float32 summation-order differences then cannot flip an argmax).
INITIALIZER_RANGE = 0.2
SEED = 1234

COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": INITIALIZER_RANGE,
}

# Flags a hybrid server needs here. The Mamba state pool holds one slot a running request
# (--max-mamba-cache-size, small: the default sizes it from free memory). SGLang's radix cache
# for Mamba state wants the "extra_buffer" strategy (refused off GPU) or no_buffer with no
# overlap scheduling; without the radix cache neither is needed (facts section 3).
HYBRID_ARGS = ("--max-mamba-cache-size", "16", "--disable-radix-cache")


def _config(arch: str) -> Any:
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        # GDN, full attention, GDN, full attention (SGLang reads full_attention_interval,
        # transformers layer_types). SGLang's Qwen3-Next puts a sparse MoE block in every
        # layer (mlp_only_layers is not read), so the checkpoint must too.
        return Qwen3NextConfig(
            **COMMON,
            num_hidden_layers=4,
            full_attention_interval=2,
            layer_types=["linear_attention", "full_attention"] * 2,
            intermediate_size=256,
            partial_rotary_factor=0.25,
            linear_conv_kernel_dim=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,  # two value heads a key head (GQA-like in the delta rule)
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if arch == "nemotron_h":
        from transformers import NemotronHConfig

        # Mamba2, attention, MLP, Mamba2, MLP: two Mamba layers around the attention layer.
        return NemotronHConfig(
            **COMMON,
            layers_block_type=["mamba", "attention", "mlp", "mamba", "mlp"],
            intermediate_size=256,
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=32,  # 8 x 32 = 2 x hidden: expand 2
            n_groups=2,
            conv_kernel=4,
            expand=2,
            chunk_size=64,  # longer prompts cross chunk boundaries of the scan
            mamba_ssm_cache_dtype="float32",
        )
    if arch == SWA_ARCH:
        from transformers import MellumConfig

        # Sliding, full, sliding, full; dense MLPs everywhere (Mellum's MoE is not needed for
        # the pool, and a dense MLP keeps the checkpoint tiny). Each layer kind its own RoPE.
        return MellumConfig(
            **COMMON,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            mlp_layer_types=["dense"] * 4,
            sliding_window=SWA_WINDOW,
            intermediate_size=256,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    if arch == MLA_ARCH:
        from transformers import DeepseekV2Config

        # Three MLA layers with dense MLPs (first_k_dense_replace covers them all), no q LoRA;
        # a latent of 64 + 16 rope dims a token (320 bytes in float32). SGLang's CPU rotary
        # embedding is DeepSeek's yarn only; at factor 1 yarn is the plain rotary embedding
        # (no interpolation, mscale 1), which transformers computes too.
        return DeepseekV2Config(
            **{**COMMON, "num_key_value_heads": 4, "head_dim": 16},
            num_hidden_layers=3,
            intermediate_size=256,
            kv_lora_rank=64,
            q_lora_rank=None,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            first_k_dense_replace=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **_MLA_YARN},
        )
    raise ValueError(f"arch must be one of {(*ARCHS, SWA_ARCH, MLA_ARCH)}, not {arch!r}")


_MLA_YARN = {
    "factor": 1.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def write_hybrid_model(path: str | Path, arch: str) -> Path:
    """Build the tiny random ``arch`` model (float32, fixed seed) and save it, with a tokenizer,
    to ``path``. Runs where SGLang's transformers is."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    sys.path.insert(0, str(TESTS))
    from vllm_model import make_tokenizer

    path = Path(path)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    model.eval()
    # No sampling defaults for the server to apply to requests that set none.
    model.generation_config = GenerationConfig(
        bos_token_id=COMMON["bos_token_id"],
        eos_token_id=COMMON["eos_token_id"],
        pad_token_id=COMMON["pad_token_id"],
        do_sample=False,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if arch == "nemotron_h":
        _sglang_nemotron_h_config(path / "config.json")
    if arch == MLA_ARCH:
        _sglang_deepseek_v2_config(path / "config.json")
    make_tokenizer(path, COMMON["vocab_size"])
    return path


# transformers 5.19 -> SGLang 0.5.23 names of Nemotron-H's layer kinds.
_BLOCK_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def _sglang_nemotron_h_config(config_json: Path) -> None:
    """Rewrite transformers 5.19's Nemotron-H config.json into what SGLang 0.5.23's own
    NemotronHConfig reads (SGLang loads its class for model_type nemotron_h, not transformers'):

    - layer kinds: transformers writes "linear_attention"/"full_attention", which SGLang's
      validator refuses ("mamba", "attention", "mlp", "moe");
    - the Mamba fields under SGLang's names (mamba_n_groups, mamba_d_conv, ...): without them
      SGLang's MambaMixer2 takes its defaults (8 groups) while its state pool reads n_groups;
    - time_step_limit: transformers writes its infinity as {"__float__": "Infinity"}, which
      SGLang would take as the limit itself; dropped, SGLang's default (0, inf) is the same;
    - mtp_layers_block_type: transformers' default, in its names; no MTP layers here.
    """
    config = json.loads(config_json.read_text())
    config["layers_block_type"] = [_BLOCK_NAMES.get(b, b) for b in config["layers_block_type"]]
    config.pop("mtp_layers_block_type", None)
    config.pop("time_step_limit", None)
    config.update(
        mamba_n_groups=config["n_groups"],
        mamba_d_conv=config["conv_kernel"],
        mamba_expand=config["expand"],
        mamba_chunk_size=config["chunk_size"],
        mamba_conv_bias=config["use_conv_bias"],
        mamba_ssm_dtype=config["mamba_ssm_cache_dtype"],
    )
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _sglang_deepseek_v2_config(config_json: Path) -> None:
    """Add to transformers 5.19's DeepSeek-V2 config.json the two fields SGLang 0.5.23 reads and
    transformers no longer writes: ``rope_scaling`` (its CPU rotary embedding asks for
    ``deepseek_yarn``: "Only deepseek_yarn is supported for CPU") and ``moe_layer_freq`` (an
    AttributeError without it)."""
    config = json.loads(config_json.read_text())
    config["rope_scaling"] = {"type": "yarn", **_MLA_YARN}
    config["moe_layer_freq"] = 1
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_hybrid_model(python: Path, root: Path, arch: str) -> Path:
    """:func:`write_hybrid_model` run by ``python`` (the SGLang venv's), into ``root / arch``."""
    path = root / arch
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
        f"from sglang_hybrid_models import write_hybrid_model; "
        f"write_hybrid_model({str(path)!r}, {arch!r})"
    )
    subprocess.run([str(python), "-c", code], check=True, capture_output=True, timeout=300)
    return path


# Every model the SGLang test modules serve: directory name -> what builds it ("qwen3": the
# dense tiny model of tests/vllm_model.py; the others: write_hybrid_model's archs).
SUITE_MODELS = {"tiny-qwen3": "qwen3", **{a: a for a in (*ARCHS, SWA_ARCH, MLA_ARCH)}}


def make_models(python: Path, root: Path) -> dict[str, Path]:
    """Every model of :data:`SUITE_MODELS` under ``root``, built by ``python`` (the SGLang
    venv's) in one process: torch and transformers imported once for all (some 8 s of CPU a
    process here), not once a test module."""
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
        f"from sglang_hybrid_models import write_suite_models; "
        f"write_suite_models({str(root)!r})"
    )
    subprocess.run([str(python), "-c", code], check=True, capture_output=True, timeout=300)
    return {name: root / name for name in SUITE_MODELS}


def write_suite_models(root: str | Path) -> None:
    """:func:`make_models`' work, where SGLang's transformers is."""
    sys.path.insert(0, str(TESTS))
    from vllm_model import make_tiny_model

    for name, arch in SUITE_MODELS.items():
        path = Path(root) / name
        if arch == "qwen3":
            make_tiny_model(str(path), arch)
        else:
            write_hybrid_model(path, arch)


def transformers_greedy(
    path: str | Path, prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    """Greedy ids of transformers' own forward of the checkpoint at ``path`` (float32, its
    pure-torch GDN / Mamba2 functions): an implementation of the model independent of SGLang and
    of the stand-in kernels. Runs where SGLang's transformers is."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    ids = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                # As the servers' ignore_eos: EOS is generated like any other token, and
                # generation goes on after it (min_new_tokens would forbid it instead).
                eos_token_id=None,
                do_sample=False,
            )
            ids.append(out[0, len(prompt) :].tolist())
    return ids


# One process of SGLang's venv a test process answers every reference_ids call: torch and
# transformers imported once (some 8 s of CPU a process here), not once a call.
_GREEDY_LOOP = (
    f"import json, sys; sys.path.insert(0, {str(TESTS)!r}); "
    f"from sglang_hybrid_models import transformers_greedy\n"
    f"answers, sys.stdout = sys.stdout, sys.stderr  # a stray print cannot pass for an answer\n"
    f"for line in sys.stdin:\n"
    f"    print(json.dumps(transformers_greedy(*json.loads(line))), file=answers, flush=True)"
)
_GREEDY: dict[Path, tuple[subprocess.Popen[str], Any]] = {}
_GREEDY_LOCK = threading.Lock()


def reference_ids(
    python: Path, path: Path, prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    """:func:`transformers_greedy` run by ``python`` (the SGLang venv's), in one process of it
    that this process keeps for every call."""
    with _GREEDY_LOCK:
        proc, errors = _GREEDY.get(python, (None, None))
        if proc is None or proc.poll() is not None:
            if not _GREEDY:
                atexit.register(_stop_greedy)
            errors = tempfile.TemporaryFile()  # noqa: SIM115 (open as long as the process)
            proc = subprocess.Popen(
                [str(python), "-c", _GREEDY_LOOP],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )
            _GREEDY[python] = (proc, errors)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([str(path), prompts, max_new]) + "\n")
        proc.stdin.flush()
        ready = select.select([proc.stdout], [], [], 600)[0]
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            proc.wait()
            errors.seek(0)
            tail = errors.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"transformers' reference of {path} gave nothing:\n{tail}")
    return json.loads(line)


def _stop_greedy() -> None:
    for proc, _ in _GREEDY.values():
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    write_hybrid_model(sys.argv[1], sys.argv[2])
