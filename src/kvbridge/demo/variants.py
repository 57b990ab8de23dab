"""Config variations whose fields must move together (issue 33): for each causal-LM family, the
fields that say which layer is what (:func:`structure_fields`), and configs that change them
together (:func:`derived_variants`: layer counts with their type lists, patterns, id lists and
periods; :func:`group_variants`: head counts with their groups), so that the suite, not a user,
finds the next scaling that breaks a config's invariants."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

_PERIODIC = re.compile(r"interval|period|step|freq")


def structure_fields(model_type: str) -> tuple[str | None, dict[str, str]]:
    """The fields of ``model_type``'s config class that say which layer is what, by what each
    holds: ``types`` (a list of layer types, one a layer), ``pattern`` (a string, a character
    a layer), ``ids`` (a list of layer indices), ``period`` or ``offset`` (an int placing a
    kind of layer every so many layers); found from the class's own defaults. And the field of
    the layer count, None where the class derives it (Nemotron-H: from its layer types)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kvbridge.demo.configs import is_structure_field
    from kvbridge.demo.scaling import declared_defaults

    cls = CONFIG_MAPPING[model_type]
    try:
        base = cls()
    except Exception:  # noqa: BLE001 - a class whose defaults do not build
        return None, {}
    declared = declared_defaults(model_type)
    count = getattr(cls, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    layers = getattr(base, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return None, {}
    out: dict[str, str] = {}
    for name in sorted(declared):
        if name == count or not is_structure_field(name):
            continue
        try:
            value = getattr(base, name, None)
        except Exception:  # noqa: BLE001 - heterogeneous configs refuse some global reads
            continue
        if (
            isinstance(value, list)
            and value
            and len(value) == layers
            and all(isinstance(v, str) for v in value)
        ):
            out[name] = "types"
        elif isinstance(value, str) and len(value) == layers and len(value) > 1:
            out[name] = "pattern"
        elif re.search(r"_ids$|_indices$|_idxs$|_layers$", name) and (
            value is None
            or (
                isinstance(value, list)
                and all(type(v) is int and 0 <= v < layers for v in value)
                and value == sorted(set(value))
            )
        ):
            out[name] = "ids"
        elif type(value) is int and _PERIODIC.search(name):
            out[name] = "period"
        elif type(value) is int and "offset" in name:
            out[name] = "offset"
    return (count if count in declared else None), out


def derived_variants(
    model_type: str, seed: int = 0, draws: int = 2
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Configs of ``model_type`` whose fields must move together: the layer count changed with
    every field that says which layer is what (:func:`structure_fields`), drawn at random from
    the values the class's defaults use, and built by the class itself; each as
    ``save_pretrained`` writes it (the fields the class derives from these saved too), by the
    standard names of the class's ``attribute_map`` (Zamba2's ``layer_types`` for its
    ``layers_block_type``), and as the source fields alone (everything derived left to the
    class). A draw the class refuses is skipped."""
    import random

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    count, fields = structure_fields(model_type)
    if not fields:
        return
    cls = CONFIG_MAPPING[model_type]
    base = cls()
    standard = {own: std for std, own in getattr(cls, "attribute_map", {}).items()}
    rng = random.Random(f"{model_type}/{seed}")
    for _ in range(draws):
        n = rng.randint(2, 6)
        source: dict[str, Any] = {}
        if count is not None:
            source[count] = n
        periods = [1]
        for name, what in fields.items():
            if what in ("types", "pattern"):
                values = sorted(set(getattr(base, name)))
                if what == "types" and len(values) == 1 and values[0].endswith("_attention"):
                    # one kind of layer by default (Granite-MoE-Hybrid: all recurrent): a
                    # user's config mixes in full attention
                    values = sorted({*values, "full_attention"})
                drawn = values[:n] + [rng.choice(values) for _ in range(n - len(values))]
                rng.shuffle(drawn)
                source[name] = "".join(drawn) if what == "pattern" else drawn
            elif what == "ids":
                source[name] = sorted(rng.sample(range(n), rng.randint(1, n)))
            elif what == "period":
                source[name] = rng.randint(1, n)
                periods.append(source[name])
        for name, what in fields.items():
            if what == "offset":
                source[name] = rng.randrange(max(periods))
        try:
            built = cls(**source)
        except Exception:  # noqa: BLE001 - a draw the class refuses is no config transformers runs
            continue
        saved = dict(json.loads(built.to_json_string()))
        shown = ", ".join(f"{k}={v!r}" for k, v in source.items())
        yield f"{shown}, as saved", saved
        if any(k in standard for k in source):
            renamed: dict[str, Any] = {str(standard.get(k, k)): v for k, v in saved.items()}
            yield f"{shown}, by standard names", renamed
        yield f"{shown}, sources only", {"model_type": model_type, **source}


# (heads, their groups): the second must divide the first, and scaling keeps both
HEAD_GROUPS = (
    ("num_attention_heads", "num_key_value_heads"),
    ("mamba_n_heads", "mamba_n_groups"),
    ("mamba_num_heads", "n_groups"),
    ("n_mamba_heads", "mamba_ngroups"),
    ("num_heads", "n_groups"),
    ("linear_num_value_heads", "linear_num_key_heads"),
)


# (an encoder-decoder config's causal LM is its decoder: its heads may differ from the
# encoder's, which the standard names map to; every divisor of the default is drawn)
ENCODER_DECODER_HEADS = (("encoder_attention_heads", "decoder_attention_heads"),)


def group_variants(model_type: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Configs of ``model_type`` with other head ratios: for each pair of
    :data:`HEAD_GROUPS` (and :data:`ENCODER_DECODER_HEADS`) the class declares, every divisor
    of its default head count as the group count (GQA 1:1 to MQA, Mamba2 groups, GDN key
    heads, a decoder's own heads), built by the class itself and saved. A ratio the class
    refuses is skipped."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from kvbridge.demo.scaling import declared_defaults

    cls, declared = CONFIG_MAPPING[model_type], declared_defaults(model_type)
    try:
        base = cls()
    except Exception:  # noqa: BLE001 - a class whose defaults do not build
        return
    for heads, groups in HEAD_GROUPS + ENCODER_DECODER_HEADS:
        try:  # (a heterogeneous config refuses global reads of per-layer fields)
            n = getattr(base, heads) if heads in declared and groups in declared else None
            now = getattr(base, groups)
        except Exception:  # noqa: BLE001
            continue
        if type(n) is not int or n < 1:
            continue
        for g in (d for d in range(1, n + 1) if n % d == 0 and d != now):
            try:
                built = cls(**{groups: g})
            except Exception:  # noqa: BLE001 - a ratio the class refuses
                continue
            yield f"{groups}={g} of {heads}={n}", dict(json.loads(built.to_json_string()))
