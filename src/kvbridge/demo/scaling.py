"""A user's config at the demo's size: the architecture is the config's own; its size is
scaled down so that every process of a case builds and runs it in seconds on a CPU, keeping
every property the transfer depends on:

- kept as they are: the layer count and every field that says which layer is what (layer
  types, hybrid patterns, attention layer indices), the attention and KV head counts (which TP
  sizes fit, GQA replication), Mamba/GDN/KDA head and group counts, conv kernels, MLA and the
  sparse-attention indexer (present or not), the model type and its options;
- scaled down: head dims, MLA ranks, state sizes, MLP widths (and the hidden size, to a size
  the model's own constraints allow), experts (4, 2 per token), the vocabulary (256: the demo's
  tokenizer is the prompt's bytes), and sliding windows (to 16, so that the demo's prompt
  crosses them; XLNet's ``mem_len`` too), and DeepSeek V4's compression rates (to 8 at most);
- dropped: quantization (the demo runs float32) and remote-code hooks;
- and every relation between fields kept (issue 33): the fields reach the class by its own
  names, so that what it derives from them (Zamba2's ``hybrid_layer_ids`` from its
  ``layers_block_type``) is derived from the config's values; a size the config states at
  what the class would derive (Zamba's ``attention_hidden_size``) is derived again from the
  scaled fields; keys and values of different head dims keep their ratio; a heterogeneous
  config's per-layer sizes are scaled in the ratio of the config's own, and a head size that is
  the sum of two others stays their sum.
"""

from __future__ import annotations

import itertools
from typing import Any

from kvbridge.demo import hfconfig
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
    "ffn_dim": 64,  # OPT, XGLM, Moshi
    "encoder_ffn_dim": 64,  # Blenderbot
    "decoder_ffn_dim": 64,
    "dff": 64,  # CTRL
    "dim_ff": 64,  # CPM-Ant
    "dim_head": 16,  # CPM-Ant's head dim (its attention width is heads x dim_head)
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
    "linear_head_dim": 16,  # Kimi Linear's KDA heads
}
# These are scaled only where the config has them: absent (None), the feature is absent.
# (rotary_dim: GPT-J's and CodeGen's rotated part of a head, at most the head dim of 8 below)
# (swa_head_dim: Inkling's sliding layers' head dim, beside head_dim)
_IF_PRESENT = {
    "head_dim": 16,
    "swa_head_dim": 16,
    "q_lora_rank": 48,
    "sliding_window": 16,
    "rotary_dim": 8,
    "mem_len": 16,  # XLNet's memory: the last mem_len tokens' hidden states
    "o_lora_rank": 32,  # DeepSeek V4's grouped output projection's rank
}
# More attention heads than this, and a head dim of hidden / heads: 4 per head, not 8.
_MANY_HEADS = 64
# fields that only make sense at the real size, or that the demo sets itself
DROP = (
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


def init_params(model_type: str) -> set[str]:
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return set(inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters)


def scaled(config: dict[str, Any], model_type: str, *, tie_width: bool = False) -> dict[str, Any]:
    """``config`` at the demo's size (see the module docstring). ``tie_width``: an attention
    width (heads x head_dim) the config has equal to its hidden size stays equal to it, for a
    class that needs it (Helium's output projection maps the hidden size to itself); not by
    default, as most classes do not and a hidden size of heads x 16 makes a many-headed model
    large (:func:`kvbridge.demo.forward.proven` tries it where the forward fails)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    params = init_params(model_type)
    out = {k: v for k, v in _canonical(config, model_type).items() if k not in DROP}
    tied = _int(out.get("num_attention_heads"), 0) * _int(out.get("head_dim"), 0) == _int(
        out.get("hidden_size"), -1
    )
    if "intermediate_size" not in params:
        out.pop("intermediate_size", None)  # derived (Mamba1: expand x hidden)
    head_dims = (_int(out.get("head_dim"), 0), _int(out.get("v_head_dim"), 0))  # as given
    for name, small in _SIZES.items():
        if name in params or name in out:
            out[name] = min(_int(out.get(name), small), small)
    sub = out.get("linear_attn_config")
    if isinstance(sub, dict) and isinstance(sub.get("head_dim"), int):
        # Kimi Linear's checkpoint names its KDA heads here, and the class reads them from here
        # over its own fields: scaled like linear_head_dim.
        out["linear_attn_config"] = {**sub, "head_dim": min(sub["head_dim"], 16)}
    for name in out:
        if "vocab_size" in name and isinstance(out[name], int):  # Gemma 3n's per-layer inputs
            out[name] = 256
    for name, small in _IF_PRESENT.items():
        if out.get(name) is not None:
            out[name] = min(_int(out[name], small), small)
    rates = out.get("compress_rates")
    if isinstance(rates, dict):  # DeepSeek V4's: a compressed entry every 4 and 128 tokens
        # to at most 8, so that the demo's prompt closes windows and its pages of 8 tokens
        # hold whole entries
        out["compress_rates"] = {k: min(_int(v, 8), 8) for k, v in rates.items()}
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
        hidden = heads * (out["head_dim"] if tie_width and tied else -(-64 // heads))
        k, v = head_dims
        if k and v and k != v and "v_head_dim" in out:
            # Values of another head dim than keys (MiMo-V2-Flash: 192 and 128) stay so,
            # in the same ratio: equal at the demo's size, they would hide what the real
            # model's cache is.
            small = max(1, out["head_dim"] * v // k)
            out["v_head_dim"] = small if small != out["head_dim"] else small + 1
    else:
        # head_dim is hidden / heads here: 8 keeps many-headed models small, and 4 past 64
        # heads (GLM-4.5's 96 heads x 8 over its 46 layers would still be 76M parameters)
        hidden = heads * (8 if heads <= _MANY_HEADS else 4)
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
    factors = [out[k] for k in ("qk_dim_factor", "v_dim_factor") if _number(out.get(k))]
    while any((hidden * f) % 64 for f in factors):
        # xLSTM: its config rounds hidden x factor up to a multiple of 64, its model does not;
        # they agree (and the model runs) only where the product is one already.
        hidden += 64
        if hidden > 1024:
            raise SpecError(
                f"{model_type}: cannot scale down: no hidden size up to 1024 makes hidden x "
                f"{factors} multiples of 64 (its model and config disagree otherwise)"
            )
    if isinstance(out.get("lru_width"), int):
        out["lru_width"] = hidden  # RecurrentGemma: a multiple of its heads, as hidden is
    out["hidden_size"] = hidden
    given = _canonical(config, model_type)
    _keep_equal(given, out)
    for name, sub in out.items():
        if isinstance(sub, dict) and sub.get("model_type") in CONFIG_MAPPING:
            # a model of its own inside this one (Git's vision encoder), by its class's rules
            own = sub["model_type"]
            out[name] = {**scaled({**declared_defaults(own), **sub}, own), "model_type": own}
        elif isinstance(sub, dict) and "model_type" in sub:  # a part (DBRX's ffn_config)
            out[name] = _scaled_part(sub, hidden)
    if isinstance(out.get("per_layer_config"), dict):
        layers = {k: v for k, v in out["per_layer_config"].items() if isinstance(v, dict)}
        out["per_layer_config"] = {k: _scaled_layer(v, given, out) for k, v in layers.items()}
        config_wide: dict[str, int] = {}  # sums set in the config's own fields, by field
        for k, own in layers.items():
            _keep_sums(given, out, own, out["per_layer_config"][k], config_wide)
    return _own_names(out, model_type, params)


def _scaled_part(sub: dict[str, Any], hidden: int) -> dict[str, Any]:
    """A config of a part of the model (DBRX's ``ffn_config``: its MLP width and experts) at
    the demo's size, as the config's own fields are scaled."""
    part = dict(sub)
    for name, small in _SIZES.items():
        if _int(part.get(name), 0):
            part[name] = min(part[name], small)
    if _int(part.get("hidden_size"), 0):
        part["hidden_size"] = hidden
    if _int(part.get("moe_num_experts"), 0):
        part["moe_num_experts"] = min(part["moe_num_experts"], 4)
    return part


_HEAD_SIZES = ("head_dim", "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")


def _keep_equal(given: dict[str, Any], out: dict[str, Any]) -> None:
    """Head sizes the config has equal stay equal, at the smaller of their scaled sizes
    (LongCat-Flash's head_dim is its rotary width, qk_rope_head_dim: scaled apart, its rotary
    embedding no longer fits the queries' rotated part)."""
    for a, b in itertools.combinations(_HEAD_SIZES, 2):
        was_equal = _int(given.get(a), 0) and given.get(a) == given.get(b)
        if was_equal and _int(out.get(a), 0) and _int(out.get(b), 0) and out[a] != out[b]:
            out[a] = out[b] = min(out[a], out[b])


def _keep_sums(
    given: dict[str, Any],
    out: dict[str, Any],
    own: dict[str, Any],
    scaled_own: dict[str, Any],
    config_wide: dict[str, int],
) -> None:
    """A head size that a layer of a heterogeneous config has as the sum of two others, one
    of them the layer's own, stays their sum once scaled (dots3: its sliding layers' head_dim
    is their qk_nope_head_dim, 192 beside the others' 128, plus qk_rope_head_dim), in the
    layer's own fields if it is one of them, else in the config's; SpecError where two layers
    would need the config's field to be two sums."""
    was, now = {**given, **own}, {**out, **scaled_own}
    for total in _HEAD_SIZES:
        for a, b in itertools.combinations([n for n in _HEAD_SIZES if n != total], 2):
            if not (a in own or b in own) or not all(_int(was.get(n), 0) for n in (total, a, b)):
                continue
            if was[total] != was[a] + was[b] or now[total] == now[a] + now[b]:
                continue
            if total in own:
                scaled_own[total] = now[a] + now[b]
            elif config_wide.setdefault(total, now[a] + now[b]) != now[a] + now[b]:
                raise SpecError(
                    f"cannot scale down: layers need {total} to be {config_wide[total]} and "
                    f"{now[a] + now[b]} ({a} + {b}), and it is one field for all of them"
                )
            else:
                out[total] = now[a] + now[b]


def _scaled_layer(
    own: dict[str, Any], given: dict[str, Any], out: dict[str, Any]
) -> dict[str, Any]:
    """A layer's own fields (a heterogeneous config's ``per_layer_config``: Gemma 4's global
    layers' head_dim of 512 beside 256, dots3's kv_lora_rank) scaled as the config's field of
    the same name was, in the same ratio: a layer that differs stays different."""
    scaled_own = dict(own)
    for name, value in own.items():
        was, now = given.get(name), out.get(name)
        if _int(value, 0) and _int(was, 0) and _int(now, 0) and now != was:
            scaled_own[name] = max(1, value * now // was)
    return scaled_own


def restated(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The sizes ``config`` states at exactly what the class derives when they are left unset
    (Zamba's ``attention_hidden_size`` = 2 x hidden, ``mamba_dt_rank`` = hidden / 16, as
    ``save_pretrained`` writes them), with their unset defaults: to be left unset again, so
    that the class derives them from the scaled fields instead of keeping the real model's."""
    from transformers.utils import logging

    unset = {
        k: d
        for k, d in declared_defaults(model_type).items()
        if (d is None or isinstance(d, str)) and _int(config.get(k), 0) > 0
    }
    if not unset:
        return {}
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        out = {}
        for name, default in unset.items():
            try:
                built = hfconfig.for_model(model_type, **{**config, name: default})
                derived = getattr(built, name, None)  # a per-layer field raises here
            except Exception:  # noqa: BLE001 - the field is not the class's to derive
                continue
            if derived == config[name]:
                out[name] = default
        return out
    finally:
        logging.set_verbosity(verbosity)


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
    for own in [k for k in out if k.startswith("encoder_") and k.endswith("_heads")]:
        # An encoder-decoder config's causal LM is its decoder alone (Whisper's, BART's), yet
        # the standard head counts map to the encoder's fields: those read the decoder's, as
        # the model built has them. (Not the layer count: transformers' own cache has the
        # encoder's, and a decoder of more layers fails in transformers itself.)
        twin = "decoder_" + own.removeprefix("encoder_")
        if out.get("is_encoder_decoder") and out.get(twin) is not None:
            out[own] = out[twin]
    mapped = {
        standard: own
        for standard, own in getattr(CONFIG_MAPPING[model_type], "attribute_map", {}).items()
        if own in out and standard not in out
    }
    # One field of the class can stand for several standard ones (Whisper's
    # encoder_attention_heads is both num_attention_heads and num_key_value_heads): each
    # standard name gets the value, the class's own name goes once all have it.
    for standard, own in mapped.items():
        out[standard] = out[own]
    for own in set(mapped.values()):
        out.pop(own, None)
    return out


def token_ids(config: dict[str, Any], params: set[str], defaults: dict[str, Any]) -> None:
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


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
