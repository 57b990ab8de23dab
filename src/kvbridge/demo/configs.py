"""A user's Hugging Face config as a demo case (``kvbridge demo --model PATH``).

The architecture is the config's own; its size is scaled down so that every process of a case
builds and runs it in seconds on a CPU, keeping every property the transfer depends on:

- kept as they are: the layer count and every field that says which layer is what (layer
  types, hybrid patterns, attention layer indices), the attention and KV head counts (which TP
  sizes fit, GQA replication), Mamba/GDN head and group counts, conv kernels, MLA and the
  sparse-attention indexer (present or not), the model type and its options;
- scaled down: head dims, MLA ranks, state sizes, MLP widths (and the hidden size, to a size
  the model's own constraints allow), experts (4, 2 per token), the vocabulary (256: the demo's
  tokenizer is the prompt's bytes), and sliding windows (to 16, so that the demo's prompt
  crosses them);
- dropped: quantization (the demo runs float32) and remote-code hooks;
- and every relation between fields kept (issue 33): the fields reach the class by its own
  names, so that what it derives from them (Zamba2's ``hybrid_layer_ids`` from its
  ``layers_block_type``) is derived from the config's values; keys and values of different
  head dims keep their ratio; and :func:`same_structure` refuses, naming the field, a scaled
  config that says of some layer other than the config as given does.

``full_size`` keeps the config's dimensions (vocabulary aside) for who has the memory; given
a model directory as Hugging Face saves it (config.json beside its weights), it serves those
weights, with the model's own vocabulary and, where the directory has a ``tokenizer.json``,
its tokenizer: the user checks the model they will deploy, not only its shape.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvbridge.demo.models import CASES, UNCHUNKED, ModelCase, tokenizer
from kvbridge.errors import SpecError

# width -> the demo's size. These are set whenever the architecture takes them: a config
# that leaves one out gets the class default, which is a real model's size.
_SIZES = {
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "index_topk": 8,
    "intermediate_size": 64,
    "ffn_hidden_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "mamba_d_head": 8,
    "mamba_head_dim": 8,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "state_size": 16,
    "time_step_rank": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
# These are scaled only where the config has them: absent (None), the feature is absent.
# (rotary_dim: GPT-J's and CodeGen's rotated part of a head, at most the head dim of 8 below)
_IF_PRESENT = {"head_dim": 16, "q_lora_rank": 48, "sliding_window": 16, "rotary_dim": 8}
# fields that only make sense at the real size, or that the demo sets itself
_DROP = (
    "quantization_config",
    "auto_map",
    "architectures",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "mamba_d_ssm",
    "qk_head_dim",
    "num_nextn_predict_layers",
)
_DEFAULT_TOPOLOGIES = (("tp2-tp1", "shm"), ("tp1-tp2", "tcp"), ("pp2-pp1", "shm"))


def read_config(path: str | Path) -> dict[str, Any]:
    """The config at ``path`` (a config.json, or a directory holding one); a multimodal
    model's text config."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(
            f"no model config at {str(path)!r}: expected one of the demo models "
            f"({', '.join(CASES)}), a config.json, or a directory holding one"
        ) from None
    except (OSError, ValueError) as e:
        raise SpecError(f"{p}: not a readable JSON config: {e}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{p}: a config is a JSON object, got {type(raw).__name__}")
    return raw


def _model_type(config: dict[str, Any], where: str) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    mt = str(config["model_type"])
    if mt == "gemma3":
        mt = "gemma3_text"  # the text model of a Gemma 3 config
    if mt not in CONFIG_MAPPING:
        raise SpecError(
            f"{where}: model_type {mt!r} is not an architecture the installed transformers knows"
        )
    return mt


def _defaults(model_type: str, where: str) -> dict[str, Any]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return dict(CONFIG_MAPPING[model_type]().to_dict())
    except Exception as e:  # noqa: BLE001 - a class whose defaults do not validate
        raise SpecError(f"{where}: {model_type}'s default config does not build: {e}") from None


def declared_defaults(model_type: str) -> dict[str, Any]:
    """The defaults the class declares for its fields (not what its ``__post_init__`` derives
    from them: a layer pattern derived for the default layer count is wrong for another)."""
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return {
        name: p.default
        for name, p in inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _params(model_type: str) -> set[str]:
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return set(inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters)


def scaled(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``config`` at the demo's size (see the module docstring)."""
    params = _params(model_type)
    out = {k: v for k, v in _canonical(config, model_type).items() if k not in _DROP}
    if "intermediate_size" not in params:
        out.pop("intermediate_size", None)  # derived (Mamba1: expand x hidden)
    head_dims = (_int(out.get("head_dim"), 0), _int(out.get("v_head_dim"), 0))  # as given
    for name, small in _SIZES.items():
        if name in params or name in out:
            out[name] = min(_int(out.get(name), small), small)
    for name in out:
        if "vocab_size" in name and isinstance(out[name], int):  # Gemma 3n's per-layer inputs
            out[name] = 256
    for name, small in _IF_PRESENT.items():
        if out.get(name) is not None:
            out[name] = min(_int(out[name], small), small)
    heads = out.get("num_attention_heads")
    mla = "kv_lora_rank" in out
    if not isinstance(heads, int):
        hidden = 64
    elif mla:  # the head dims are MLA's own; some classes want hidden a multiple of the heads
        hidden = heads * -(-64 // heads)
    elif "head_dim" in params or "head_dim" in out:
        # The attention width is heads x head_dim, whatever the hidden size; some classes still
        # want the hidden size a multiple of the heads.
        out["head_dim"] = min(_int(out.get("head_dim"), 16), 16)
        hidden = heads * -(-64 // heads)
        k, v = head_dims
        if k and v and k != v and "v_head_dim" in out:
            # Values of another head dim than keys (MiMo-V2-Flash: 192 and 128) stay so,
            # in the same ratio: equal at the demo's size, they would hide what the real
            # model's cache is.
            small = max(1, out["head_dim"] * v // k)
            out["v_head_dim"] = small if small != out["head_dim"] else small + 1
    else:
        hidden = heads * 8  # head_dim is hidden / heads here: 8 keeps many-headed models small
    n_heads = out.get("mamba_n_heads", out.get("n_mamba_heads"))
    d_head = out.get("mamba_d_head")
    if isinstance(out.get("expand"), int) and isinstance(out.get("num_heads"), int):
        # Mamba2: hidden x expand must be num_heads x head_dim; keep the heads, scale the rest.
        heads, expand = out["num_heads"], out["expand"]
        out["head_dim"] = 4
        if (heads * 4) % expand:
            raise SpecError(
                f"{model_type}: cannot scale down: {heads} heads x head_dim 4 is no multiple "
                f"of expand {expand}"
            )
        hidden = heads * 4 // expand
    if "mamba_d_ssm" in params and isinstance(n_heads, int) and isinstance(d_head, int):
        out["mamba_d_ssm"] = n_heads * d_head  # Falcon-H1: the Mamba width, stated
    elif isinstance(out.get("mamba_expand"), int) and isinstance(n_heads, int):
        # Bamba, Zamba2: the Mamba width is expand x hidden, and must be n_heads x d_head.
        width = out["mamba_expand"] * hidden
        if width % n_heads:
            raise SpecError(
                f"{model_type}: cannot scale down: {n_heads} Mamba heads do not "
                f"divide {out['mamba_expand']} x hidden size {hidden}"
            )
        if "mamba_d_head" in params:
            out["mamba_d_head"] = width // n_heads
    out["hidden_size"] = hidden
    return _own_names(out, model_type, params)


def _own_names(config: dict[str, Any], model_type: str, params: set[str]) -> dict[str, Any]:
    """``config`` with the class's own spelling back where :func:`_canonical` took it away and
    the class declares the field: a field passed by its standard name reaches the class only
    after its ``__post_init__`` has derived the others from the default (Zamba2's
    ``hybrid_layer_ids`` from the default 54-layer ``layers_block_type``, not the config's)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = dict(config)
    for standard, own in getattr(CONFIG_MAPPING[model_type], "attribute_map", {}).items():
        if standard in out and own in params:  # the standard name holds the config's value
            out[own] = out.pop(standard)
    return out


def _canonical(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``config`` with transformers' standard field names where the class spells them its own
    way (GPT-2's ``n_head`` is ``num_attention_heads``: its ``attribute_map``), so that the
    scaling rules see them; the class maps them back when the config is built."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = dict(config)
    for standard, own in getattr(CONFIG_MAPPING[model_type], "attribute_map", {}).items():
        if own in out and standard not in out:
            out[standard] = out.pop(own)
    return out


def _token_ids(config: dict[str, Any], params: set[str], defaults: dict[str, Any]) -> None:
    """The demo's vocabulary is 256 byte tokens: a special token id of a real vocabulary (the
    user's, or the class's default: a real model's) would index past it. Such an id becomes
    None where the class allows none (its default is None), else one of the top byte ids, which
    the demo's ASCII prompt never holds."""
    top = iter(range(255, 127, -1))
    for field in sorted(f for f in params if f.endswith("_token_id")):
        value = config.get(field, defaults.get(field))  # dropped while scaling: the default
        ids = value if isinstance(value, list) else [value]
        if all(i is None or (isinstance(i, int) and 0 <= i < 256) for i in ids):
            continue
        config[field] = None if defaults.get(field) is None else next(top)


_SPECIAL = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _floats(value: Any) -> Any:
    """``value`` with transformers' tagged floats (``{"__float__": "Infinity"}``, as
    ``save_pretrained`` writes an infinite default) as floats again."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _SPECIAL:
            return _SPECIAL[value["__float__"]]
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# How save_pretrained names a model's weights: one file, or an index of shards.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# fields of a saved config that say nothing about the model, or that the demo sets itself
_NOT_MODEL = ("auto_map", "architectures", "_name_or_path", "torch_dtype", "dtype")


def weights_dir(path: str | Path) -> Path | None:
    """The model directory holding weights that ``path`` names (the directory, or its
    config.json), if any."""
    p = Path(path)
    p = p.parent if p.name == "config.json" else p
    return p if p.is_dir() and any((p / f).is_file() for f in WEIGHT_FILES) else None


def case_from_config(path: str | Path, *, full_size: bool = False) -> ModelCase:
    p = Path(path)  # named for its file (a preset), or for its model directory
    name = p.parent.name if p.name == "config.json" else p.stem if p.suffix == ".json" else p.name
    raw, where = read_config(path), str(path)
    home = weights_dir(path)
    if full_size and home is not None:
        return _with_weights(raw, where, name, home)
    case = case_from_raw(raw, where, name, full_size=full_size)
    if home is not None:
        case = replace(case, title=f"{case.title}, random weights (--full-size serves {where}'s)")
    return case


def _with_weights(raw: dict[str, Any], where: str, name: str, home: Path) -> ModelCase:
    """The case of a saved model served with its weights: its config as saved (vocabulary,
    special tokens, tied embeddings and all), run in float32."""
    raw = _floats(raw)
    if isinstance(raw.get("text_config"), dict) or any(
        isinstance(v, dict) and "model_type" in v for v in raw.values()
    ):
        raise SpecError(
            f"{where}: the demo serves the weights of a text-only causal LM; this config "
            f"holds sub-models"
        )
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise SpecError(f"{where}: quantized weights ({method}): the demo runs float32 only")
    if not isinstance(raw.get("model_type"), str):
        raise SpecError(f"{where}: the config has no model_type")
    mt = _model_type(raw, where)
    config = {k: v for k, v in raw.items() if k not in (*_NOT_MODEL, "model_type")}
    tokens = home / "tokenizer.json"
    case = ModelCase(
        name,
        f"{mt} from {where} (its weights)",
        mt,
        config,
        _DEFAULT_TOPOLOGIES,
        chunked=mt not in UNCHUNKED,
        full_size=True,
        weights=str(home),
        tokenizer=str(tokens) if tokens.is_file() else "",
    )
    if case.tokenizer:
        tokenizer(case)  # one that does not read is refused now, not in a worker
    return case


def case_from_raw(
    raw: dict[str, Any], where: str, name: str, *, full_size: bool = False
) -> ModelCase:
    """A config (as read from JSON) as a demo case; ``where`` names it in errors."""
    raw = _floats(raw)
    if isinstance(raw.get("text_config"), dict):  # Gemma 3 and other multimodal configs
        raw = {**raw["text_config"]}
    if not isinstance(raw.get("model_type"), str):
        raise SpecError(f"{where}: the config has no model_type")
    mt = _model_type(raw, where)
    nested = sorted(k for k, v in raw.items() if isinstance(v, dict) and "model_type" in v)
    if nested:
        raise SpecError(
            f"{where}: {mt} is built of sub-models ({', '.join(nested)}), which the demo does "
            f"not scale or describe"
        )
    # The class's declared defaults under the user's fields, so that a field left out is
    # scaled like one given (its default is a real model's size); minus what the class derives
    # from the others (saved with the config, stale once the others are scaled).
    params, defaults = _params(mt), _defaults(mt, where)
    derived = set(defaults) - params
    config = declared_defaults(mt)
    ignored = derived | {"model_type", "text_config"}
    config.update((k, v) for k, v in raw.items() if k not in ignored)
    config = (
        {k: v for k, v in config.items() if k not in _DROP} if full_size else scaled(config, mt)
    )
    config.pop("model_type", None)
    _token_ids(config, params, defaults)
    case = ModelCase(
        name,
        f"{mt} from {where}" + (" (full size)" if full_size else ""),
        mt,
        config,
        _DEFAULT_TOPOLOGIES,
        chunked=mt not in UNCHUNKED,
        full_size=full_size,
    )
    if not full_size:
        same_structure(raw, case, where)
    return case


# ---- what scaling must keep: which layer is what -------------------------------------------

# Config attributes that say which layer is what: layer counts, per-layer type lists, layer id
# lists, patterns, intervals (``layer_types``, ``layers_block_type``, ``hybrid_layer_ids``,
# ``attn_layer_indices``, ``hybrid_override_pattern``, ``full_attn_idxs``, ``block_types``...),
# whether the config states them or the class derives them (its ``__post_init__``, a property).
_STRUCTURE = re.compile(
    r"layer|block|pattern|interval|period|offset|_ids$|_indices$|_idxs$|_types?$"
)
# ... but not sizes, which scaling changes on purpose (Gemma 3n's hidden_size_per_layer_input,
# Jamba's layers_num_experts), nor token ids.
_NOT_STRUCTURE = re.compile(r"size|dim|width|rank|hidden|intermediate|expert|token|vocab|dropout")


def is_structure_field(name: str) -> bool:
    """Whether a config field named ``name`` says which layer is what (not how large)."""
    return bool(_STRUCTURE.search(name)) and not _NOT_STRUCTURE.search(name) and name not in _DROP


def layer_structure(config: Any) -> dict[str, Any]:
    """What a transformers config object says about which layer is what (see
    :data:`_STRUCTURE`), and the classes of the cache layers :class:`DynamicCache` makes of it.
    Lists of increasing ints are layer ids and compared as they are; other int lists by their
    pattern (which entries are equal), as their values may be sizes."""
    names = {k for k in vars(config) if not k.startswith("_")}
    for klass in type(config).__mro__:  # derived fields the class computes on access
        names |= {k for k, v in vars(klass).items() if isinstance(v, property)}
    out: dict[str, Any] = {}
    for name in sorted(names):
        if not is_structure_field(name):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 - a property that does not apply to this config
            continue
        if isinstance(value, (list, tuple)) and all(
            isinstance(v, (str, int)) and not isinstance(v, bool) for v in value
        ):
            ints = all(isinstance(v, int) for v in value)
            if ints and any(a >= b for a, b in zip(value, value[1:], strict=False)):
                first: dict[Any, int] = {}
                value = [first.setdefault(v, len(first)) for v in value]  # the pattern
            out[name] = tuple(value)
        elif isinstance(value, (int, str)) and not isinstance(value, bool):
            out[name] = value
    try:
        from transformers.cache_utils import DynamicCache

        out["cache layers"] = tuple(type(la).__name__ for la in DynamicCache(config=config).layers)
    except Exception:  # noqa: BLE001 - the cache's description says why, later
        pass
    return out


def same_structure(raw: dict[str, Any], case: ModelCase, where: str) -> None:
    """SpecError, naming the field, unless the scaled config says of every layer what the
    config as given says (as transformers builds each): scaling that changed a field but not
    one derived from it (issue 33: Zamba2's ``hybrid_layer_ids``) is refused here, before the
    model is built, instead of failing inside transformers' forward. Nothing is compared where
    transformers does not build the config as given, or the scaled one (refused later)."""
    from transformers import AutoConfig
    from transformers.utils import logging

    from kvbridge.demo.models import hf_config

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # not its warnings on a real vocabulary's special token ids
    try:
        given = AutoConfig.for_model(
            case.model_type, **{k: v for k, v in raw.items() if k != "model_type"}
        )
        small = hf_config(case)
    except Exception:  # noqa: BLE001 - the demo's other checks say why
        return
    finally:
        logging.set_verbosity(verbosity)
    want, got = layer_structure(given), layer_structure(small)
    for name in sorted(set(want) | set(got)):
        if name == "cache layers" and (name not in want or name not in got):
            continue
        if want.get(name) != got.get(name):
            raise SpecError(
                f"{where}: scaling {case.model_type} down changed {name} "
                f"({_short(want.get(name))} as given, {_short(got.get(name))} scaled): a field "
                f"derived from another was not scaled with it"
            )


def _short(value: Any) -> str:
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 60 else text[:57] + "..."
