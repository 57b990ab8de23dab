"""A user's Hugging Face config as a demo case (``kvbridge demo --model PATH``).

The architecture is the config's own, at the demo's size (:mod:`kvbridge.demo.scaling` says
what scaling keeps, drops and scales); :func:`same_structure` refuses, naming the field, a
scaled config that says of some layer other than the config as given does.

``full_size`` keeps the config's dimensions (vocabulary aside) for who has the memory; given
a model directory as Hugging Face saves it (config.json beside its weights), it serves those
weights, with the model's own vocabulary and, where the directory has a ``tokenizer.json``,
its tokenizer: the user checks the model they will deploy, not only its shape.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from kvbridge.demo import hfconfig
from kvbridge.demo.models import CASES, UNCHUNKED, ModelCase, tokenizer
from kvbridge.demo.scaling import (
    DROP,
    declared_defaults,
    init_params,
    restated,
    scaled,
    token_ids,
)
from kvbridge.errors import SpecError

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


@cache
def _class_default(model_type: str, part: str | None = None) -> dict[str, Any] | None:
    """The class's default config (or its ``part``, a sub-config) as ``to_dict`` gives it,
    built once a type: building one validates every field (5-50 ms), and the demo's sweeps
    ask for the same few hundreds of times. Callers get copies (:func:`_copy_default`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    if part is not None:
        config = getattr(config, part)
    return dict(config.to_dict()) if hasattr(config, "to_dict") else None


def _copy_default(model_type: str, part: str | None = None) -> dict[str, Any] | None:
    return copy.deepcopy(_class_default(model_type, part))


def _defaults(model_type: str, where: str) -> dict[str, Any]:
    try:
        built = _copy_default(model_type)
    except Exception as e:  # noqa: BLE001 - a class whose defaults do not validate
        raise SpecError(f"{where}: {model_type}'s default config does not build: {e}") from None
    if built is None:
        raise SpecError(f"{where}: {model_type}'s default config has no to_dict()")
    return built


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


# How save_pretrained names a model's weights: one file, or an index of shards.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# fields of a saved config that say nothing about the model, or that the demo sets itself
_NOT_MODEL = ("auto_map", "architectures", "_name_or_path", "torch_dtype", "dtype")


def _causal_part(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The part of a composite config its causal LM is built from (its ``text_config``;
    MusicGen's ``decoder``), as given (its model type the class's for it where it names
    none), or as the class builds it by default where the config gives none
    (``{"model_type": "qwen3_5"}``). None for a text model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    given = raw.get("text_config")
    mt = raw.get("model_type")
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:  # (a lazy mapping: no .get)
        return dict(given) if isinstance(given, dict) else None
    cls = CONFIG_MAPPING[mt]
    subs = getattr(cls, "sub_configs", {})
    own = (
        MODEL_FOR_CAUSAL_LM_MAPPING[cls].config_class
        if cls in MODEL_FOR_CAUSAL_LM_MAPPING
        else None
    )
    key = next((k for k, c in subs.items() if c is own), "text_config")
    if key not in subs:
        return dict(given) if isinstance(given, dict) else None
    if isinstance(raw.get(key), dict):
        named = getattr(subs[key], "model_type", None)  # (AutoConfig where the part is any)
        return {**({"model_type": named} if named else {}), **raw[key]}
    try:
        return _copy_default(mt, key)
    except Exception:  # noqa: BLE001 - a class whose defaults do not build: refused later
        return None


def _default_sub_models(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The models inside ``model_type``'s (Git's vision encoder) that ``config`` leaves to the
    class, as the class builds them: real-size, to be scaled like those a config gives."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    missing = [k for k in getattr(cls, "sub_configs", {}) if config.get(k) is None]
    if not missing:
        return {}
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a class whose defaults do not build: refused later
        return {}
    subs: dict[str, Any] = {k: getattr(default, k, None) for k in missing}
    return {k: dict(v.to_dict()) for k, v in subs.items() if hasattr(v, "to_dict")}


def _per_layer(config: dict[str, Any], model_type: str) -> Any:
    """The ``per_layer_config`` the class derives from ``config`` (None where it derives none,
    or does not build it: the later checks say why)."""
    try:
        return hfconfig.for_model(model_type, **config).to_dict().get("per_layer_config")
    except Exception:  # noqa: BLE001 - refused later, with the reason
        return None


def weights_dir(path: str | Path) -> Path | None:
    """The model directory holding weights that ``path`` names (the directory, or its
    config.json), if any."""
    p = Path(path)
    p = p.parent if p.name == "config.json" else p
    return p if p.is_dir() and any((p / f).is_file() for f in WEIGHT_FILES) else None


def case_from_config(
    path: str | Path, *, full_size: bool = False, tie_width: bool = False
) -> ModelCase:
    p = Path(path)  # named for its file (a preset), or for its model directory
    name = p.parent.name if p.name == "config.json" else p.stem if p.suffix == ".json" else p.name
    raw, where = read_config(path), str(path)
    home = weights_dir(path)
    if full_size and home is not None:
        return _with_weights(raw, where, name, home)
    case = case_from_raw(raw, where, name, full_size=full_size, tie_width=tie_width)
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
    raw: dict[str, Any], where: str, name: str, *, full_size: bool = False, tie_width: bool = False
) -> ModelCase:
    """A config (as read from JSON) as a demo case; ``where`` names it in errors;
    ``tie_width`` as :func:`kvbridge.demo.scaling.scaled` takes it."""
    raw = _floats(raw)
    # (Gemma 3 and other multimodal configs: the text model's, given or the class's default)
    raw = _causal_part(raw) or raw
    if not isinstance(raw.get("model_type"), str):
        raise SpecError(f"{where}: the config has no model_type")
    mt = _model_type(raw, where)
    # The class's declared defaults under the user's fields, so that a field left out is
    # scaled like one given (its default is a real model's size); minus what the class derives
    # from the others (saved with the config, stale once the others are scaled).
    params, defaults = init_params(mt), _defaults(mt, where)
    # (per_layer_config is not a parameter: transformers' heterogeneous configs take it as a
    # keyword of their own, the layers' own sizes)
    derived = set(defaults) - params - {"per_layer_config"}
    config = declared_defaults(mt)
    ignored = derived | {"model_type", "text_config"}
    config.update((k, v) for k, v in raw.items() if k not in ignored)
    if not full_size:
        config.update(restated(config, mt))
        config.update(_default_sub_models(config, mt))
        if "per_layer_config" not in config:
            # The layers' own sizes as the class derives them from the config's fields (dots3's
            # sliding layers, Gemma 4's global_head_dim), so that they are scaled with the rest
            # rather than derived again at their real size.
            own = _per_layer(config, mt)
            if own:
                config["per_layer_config"] = own
    config = (
        {k: v for k, v in config.items() if k not in DROP}
        if full_size
        else scaled(config, mt, tie_width=tie_width)
    )
    config.pop("model_type", None)
    token_ids(config, params, defaults)
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
    return bool(_STRUCTURE.search(name)) and not _NOT_STRUCTURE.search(name) and name not in DROP


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
    from transformers.utils import logging

    from kvbridge.demo.models import hf_config

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # not its warnings on a real vocabulary's special token ids
    try:
        given = hfconfig.for_model(
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
