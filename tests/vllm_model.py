"""A tiny random-init model for the vLLM connector tests: no download, a few MB, built in seconds.

Runs where vLLM's transformers is (the venv scripts/vllm_env.sh builds: a model saved by another
transformers version may carry config fields vLLM's cannot read), so the tests call it as a script
with that venv's python:

    "$VLLM_PY" tests/vllm_model.py /tmp/tiny-llama --arch llama

or import it there and call ``make_tiny_model(path, arch="llama")``. The directory it writes holds
config.json, generation_config.json and model.safetensors (float32), and, unless
``tokenizer=False``, a WordLevel tokenizer: ids 0-3 are "<pad>", "<s>", "</s>", "<unk>", and any
other id ``i`` is the word ``f"t{i}"``.

vLLM 0.32.0 serves it either way (checked with `vllm serve`, /v1/completions):
- with ``--skip-tokenizer-init`` (no tokenizer needed): the prompt must be token ids (a list of
  ints, or a list of such lists); the response has ``"text": ""``, and the generated ids only
  with ``"return_token_ids": true`` (``choices[i].token_ids``); ``"logprobs": k`` is refused
  (HTTP 400, "Unable to get tokenizer") unless the request also sets
  ``"return_tokens_as_token_ids": true``, and then ``choices[i].logprobs.token_logprobs`` holds
  one float per generated token and ``tokens`` reads "token_id:309";
- with the tokenizer: token-id prompts work the same, string prompts ("t5 t17 t42") too, and
  logprobs need nothing extra (``tokens`` reads "t309").

The weights are drawn with a larger initializer_range than transformers' 0.02, so that greedy
decoding has clear margins between the top two logits; with 0.02 every logit is close to
-log(vocab) and float32 summation-order differences (another block size, another TP) can flip
an argmax, which would make token-exact comparisons flaky for reasons that are not the KV.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARCHS = ("llama", "llama_swa", "qwen3", "nemotron_h", "qwen3_next")
WINDOW = 48  # llama_swa's first layer: a sliding window shorter than the longer prompts

# One shape for every arch: 128 hidden = 4 query heads x head_dim 32, 2 KV heads (GQA), 2 layers.
SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
INITIALIZER_RANGE = 0.2
SEED = 1234


def _config(arch: str) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**SHAPE, initializer_range=INITIALIZER_RANGE)
    if arch == "llama_swa":  # a sliding-window layer, then a full one (vLLM reads layer_types)
        return LlamaConfig(
            **SHAPE,
            initializer_range=INITIALIZER_RANGE,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=WINDOW,
        )
    if arch == "qwen3":
        n = SHAPE["num_hidden_layers"]
        return Qwen3Config(
            **SHAPE,
            initializer_range=INITIALIZER_RANGE,
            use_sliding_window=False,
            max_window_layers=n,
            layer_types=["full_attention"] * n,
        )
    if arch == "nemotron_h":  # a Mamba2 hybrid: Mamba2, MLP, attention, MLP
        from transformers import NemotronHConfig

        shape = {k: v for k, v in SHAPE.items() if k != "num_hidden_layers"}
        return NemotronHConfig(
            **shape,
            initializer_range=INITIALIZER_RANGE,
            layers_block_type=["mamba", "mlp", "attention", "mlp"],
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=32,
            n_groups=2,
            conv_kernel=4,
            expand=2,
            chunk_size=256,
            mamba_ssm_cache_dtype="float32",
        )
    if arch == "qwen3_next":  # a gated-delta-net hybrid: GDN, then (gated) attention
        from transformers import Qwen3NextConfig

        # vLLM's Qwen3-Next needs one MoE layer (the attention layer's: 4 experts, 2 a token);
        # vLLM's dense Qwen3.5 text model would need torchvision, not installable here for CPU.
        return Qwen3NextConfig(
            **SHAPE,
            initializer_range=INITIALIZER_RANGE,
            layer_types=["linear_attention", "full_attention"],
            mlp_only_layers=[0],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,  # all vLLM's CPU kernel runs
            linear_num_key_heads=1,
            linear_num_value_heads=2,
        )
    raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")


def make_tokenizer(path: str | Path, vocab_size: int = SHAPE["vocab_size"]) -> None:
    """A WordLevel tokenizer split on whitespace: ids 0-3 are "<pad>", "<s>", "</s>", "<unk>",
    and every other id ``i`` is the word ``f"t{i}"``.

    The special tokens must not be prefixes of ordinary words: the tokenizer matches added tokens
    inside words before splitting, so a bos token "t1" would cut "t17" into "t1" + "7".
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {word: i for i, word in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(path))


def make_tiny_model(path: str | Path, arch: str = "llama", *, tokenizer: bool = True) -> Path:
    """Build a tiny random-init ``arch`` model (float32, fixed seed) and save it to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    config = _config(arch)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    # No sampling defaults for vLLM to pick up from generation_config.json (it applies them to
    # requests that do not set temperature etc.); requests set temperature=0 and ignore_eos.
    model.generation_config = GenerationConfig(
        bos_token_id=SHAPE["bos_token_id"],
        eos_token_id=SHAPE["eos_token_id"],
        pad_token_id=SHAPE["pad_token_id"],
        do_sample=False,
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer:
        make_tokenizer(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--no-tokenizer", action="store_true")
    args = parser.parse_args()
    out = make_tiny_model(args.path, args.arch, tokenizer=not args.no_tokenizer)
    print(json.dumps({"path": str(out), "arch": args.arch}))


if __name__ == "__main__":
    main()
