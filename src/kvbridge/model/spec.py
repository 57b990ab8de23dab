"""CacheSpec: the model's cache, independent of parallelism and memory.

A spec is a tuple of layers; a layer is a kind plus the components it caches. A component is
one tensor per token (``Scope.TOKEN``: K, V, an MLA latent, indexer keys) or one tensor per
request (``Scope.STATE``: a conv or SSM state). Each component's logical tensor, per token or
per request, is ``[rows, axis]``; the axis is a list of :class:`Segment` s (KV heads of
head_dim, Mamba heads, groups, the q|k|v channels of a conv state), each sharded independently
by the rule in :mod:`kvbridge.planner.shard`. Rows are what is not sharded: a conv state's time
steps.

Builders for real models live in :mod:`kvbridge.model.hf`.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from kvbridge.errors import SpecError


class DType(enum.Enum):
    """Element types a cache holds. The value is the name; ``itemsize`` the bytes."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3 = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"
    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, name: str) -> DType:
        key = name.removeprefix("torch.").lower()
        key = {
            "bf16": "bfloat16",
            "fp16": "float16",
            "half": "float16",
            "fp32": "float32",
            "float": "float32",
            "fp8": "float8_e4m3fn",
            "fp8_e4m3": "float8_e4m3fn",
            "float8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2",
        }.get(key, key)
        try:
            return cls(key)
        except ValueError:
            known = ", ".join(d.value for d in cls)
            raise SpecError(f"unknown dtype {name!r}; expected one of {known}") from None


_ITEMSIZE = {
    DType.FLOAT32: 4,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT8_E4M3: 1,
    DType.FLOAT8_E5M2: 1,
    DType.INT8: 1,
    DType.UINT8: 1,
}


class Scope(enum.Enum):
    TOKEN = "token"  # one tensor per token, in pages
    STATE = "state"  # one tensor per request, in a state slot


class LayerKind(enum.Enum):
    FULL = "full"  # full attention, GQA/MHA
    SLIDING = "sliding"  # sliding-window attention
    MLA = "mla"  # multi-head latent attention (one unsharded latent)
    MLA_INDEXER = "mla_indexer"  # MLA plus DeepSeek-V3.2 sparse-attention indexer keys
    MAMBA2 = "mamba2"
    GDN = "gdn"  # gated delta net (Qwen3-Next / Qwen3.5 linear attention)
    KDA = "kda"  # Kimi delta attention (Kimi Linear)
    MAMBA1 = "mamba1"
    SHORT_CONV = "short_conv"  # LFM2-style short convolution
    LIGHTNING = "lightning"  # linear attention's K^T V state a head (MiniMax lightning attention)
    MLSTM = "mlstm"  # xLSTM's matrix memory, normaliser and stabiliser a head
    RG_LRU = "rg_lru"  # RecurrentGemma's real-gated linear recurrence (and its conv)
    RWKV = "rwkv"  # RWKV-4's previous token (both mixes) and its WKV numerator, denominator, max
    PREFIX = "prefix"  # K/V of positions cached before every request's tokens (CPM-Ant's prompt)
    HIDDEN = "hidden"  # a layer's input hidden state a token, replicated (XLNet's mems)
    COMPRESSED = "compressed"  # a KV entry every few tokens (DeepSeek V4's compressed attention)


@dataclass(frozen=True)
class Segment:
    """``units`` units of ``unit_size`` elements, sharded as one piece of an axis."""

    name: str
    units: int
    unit_size: int

    def __post_init__(self) -> None:
        if self.units < 1 or self.unit_size < 1:
            raise SpecError(
                f"segment {self.name!r}: units and unit_size must be >= 1, "
                f"got units={self.units}, unit_size={self.unit_size}"
            )

    @property
    def elems(self) -> int:
        return self.units * self.unit_size


@dataclass(frozen=True)
class Component:
    """One cached tensor of a layer: logically ``[rows, axis]`` per token or per request.

    ``stride`` (per-token components only): one entry every ``stride`` tokens, not one a token:
    a compressed KV entry for each window of ``stride`` tokens (DeepSeek V4's compressed
    attention), there once the window's last token is computed. A request of ``n`` tokens has
    ``n // stride`` of them; entry ``e`` travels with the chunk holding token
    ``(e + 1) * stride - 1``, and a page of ``page_size`` tokens holds ``page_size // stride``.
    """

    name: str
    scope: Scope
    segments: tuple[Segment, ...]
    dtype: DType
    rows: int = 1
    stride: int = 1

    def __post_init__(self) -> None:
        if not self.segments:
            raise SpecError(f"component {self.name!r} has no segments")
        if self.rows < 1:
            raise SpecError(f"component {self.name!r}: rows must be >= 1, got {self.rows}")
        if self.stride < 1 or (self.stride > 1 and self.scope is not Scope.TOKEN):
            raise SpecError(
                f"component {self.name!r}: stride must be >= 1, and 1 for a "
                f"{self.scope.value} component; got {self.stride}"
            )
        names = [s.name for s in self.segments]
        if len(set(names)) != len(names):
            raise SpecError(f"component {self.name!r}: duplicate segment names {names}")

    @property
    def axis_elems(self) -> int:
        return sum(s.elems for s in self.segments)

    def entries(self, lo: int, hi: int) -> tuple[int, int]:
        """The entries completed by tokens ``[lo, hi)``: ``[lo // stride, hi // stride)``
        (those tokens themselves, for a component of one entry a token)."""
        return lo // self.stride, hi // self.stride

    @property
    def item_bytes(self) -> int:
        """Bytes of the whole logical tensor of one token (or one request's state)."""
        return self.rows * self.axis_elems * self.dtype.itemsize

    @property
    def uniform_unit_size(self) -> int | None:
        sizes = {s.unit_size for s in self.segments}
        return sizes.pop() if len(sizes) == 1 else None


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    components: tuple[Component, ...]
    window: int | None = None  # SLIDING only: the decode side needs the last `window` tokens

    def __post_init__(self) -> None:
        if not self.components:
            raise SpecError(f"{self.kind.value} layer has no components")
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise SpecError(f"{self.kind.value} layer: duplicate component names {names}")
        if (self.kind is LayerKind.SLIDING) != (self.window is not None):
            raise SpecError(
                f"a window is required for sliding layers and only for them; "
                f"got kind={self.kind.value}, window={self.window}"
            )
        if self.window is not None and self.window < 1:
            raise SpecError(f"sliding window must be >= 1, got {self.window}")
        strided = [c.name for c in self.components if c.stride > 1]
        if strided and self.window is not None:
            raise SpecError(
                f"{self.kind.value} layer: components {strided} of one entry every few tokens "
                f"in a sliding window are not described"
            )

    @property
    def per_token(self) -> bool:
        """Whether the layer has a per-token component (KV, latent, indexer keys)."""
        return any(c.scope is Scope.TOKEN for c in self.components)

    @property
    def stateful(self) -> bool:
        """Whether the layer has a per-request state (conv, SSM, recurrent)."""
        return any(c.scope is Scope.STATE for c in self.components)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise SpecError(
            f"{self.kind.value} layer has no component {name!r}; "
            f"it has {[c.name for c in self.components]}"
        )


@dataclass(frozen=True)
class CacheSpec:
    """The cache of one model: its layers, and the bytes of one request's aux slot."""

    model: str
    layers: tuple[LayerSpec, ...]
    aux_bytes: int = 64

    def __post_init__(self) -> None:
        if not self.layers:
            raise SpecError(f"model {self.model!r}: a spec needs at least one layer")
        if self.aux_bytes < 1:
            raise SpecError(f"model {self.model!r}: aux_bytes must be >= 1, got {self.aux_bytes}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of every shape and dtype; equal specs have equal fingerprints. Made at
        its first use, not with the spec: the demo's checks make thousands of specs and
        compare few (hashing a large model's took most of a spec's making)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def has_state(self) -> bool:
        return any(layer.stateful for layer in self.layers)

    def to_dict(self) -> dict[str, object]:
        """The spec as JSON values, field by field (``dataclasses.asdict`` took 17 ms a large
        model): a component's ``stride`` only where it is not 1, as specs were written before
        strides."""
        return {
            "model": self.model,
            "layers": [_layer_dict(layer) for layer in self.layers],
            "aux_bytes": self.aux_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> CacheSpec:
        try:
            layers = tuple(
                LayerSpec(
                    kind=LayerKind(layer["kind"]),
                    window=layer.get("window"),
                    components=tuple(
                        Component(
                            name=c["name"],
                            scope=Scope(c["scope"]),
                            dtype=DType(c["dtype"]),
                            rows=c.get("rows", 1),
                            stride=c.get("stride", 1),
                            segments=tuple(Segment(**s) for s in c["segments"]),
                        )
                        for c in layer["components"]
                    ),
                )
                for layer in d["layers"]  # type: ignore[attr-defined]
            )
            return cls(model=str(d["model"]), layers=layers, aux_bytes=int(d["aux_bytes"]))  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, SpecError):
                raise
            raise SpecError(f"malformed CacheSpec dict: {e!r}") from e

    def describe_difference(self, other: CacheSpec) -> str | None:
        """None if equal, else one sentence naming the first difference."""
        if self.fingerprint == other.fingerprint:
            return None
        if self.model != other.model:
            return f"model differs: {self.model!r} vs {other.model!r}"
        if self.num_layers != other.num_layers:
            return f"layer count differs: {self.num_layers} vs {other.num_layers}"
        if self.aux_bytes != other.aux_bytes:
            return f"aux_bytes differs: {self.aux_bytes} vs {other.aux_bytes}"
        for i, (a, b) in enumerate(zip(self.layers, other.layers, strict=True)):
            if a == b:
                continue
            if a.kind != b.kind or a.window != b.window:
                return (
                    f"layer {i}: kind/window differs: {a.kind.value}/{a.window} vs "
                    f"{b.kind.value}/{b.window}"
                )
            for ca, cb in zip(a.components, b.components, strict=False):
                if ca != cb:
                    return (
                        f"layer {i} component {ca.name!r}: {_component_summary(ca)} vs "
                        f"{_component_summary(cb)}"
                    )
            return (
                f"layer {i}: components differ: {[c.name for c in a.components]} vs "
                f"{[c.name for c in b.components]}"
            )
        return "specs differ"  # unreachable for well-formed specs; kept as a safe message


def _component_summary(c: Component) -> str:
    segs = ",".join(f"{s.name}={s.units}x{s.unit_size}" for s in c.segments)
    every = f" every {c.stride} tokens" if c.stride > 1 else ""
    return f"{c.name}[{c.scope.value}{every} rows={c.rows} {segs} {c.dtype.value}]"


def _layer_dict(layer: LayerSpec) -> dict[str, object]:
    return {
        "kind": layer.kind.value,
        "components": [
            {
                "name": c.name,
                "scope": c.scope.value,
                "segments": [
                    {"name": s.name, "units": s.units, "unit_size": s.unit_size} for s in c.segments
                ],
                "dtype": c.dtype.value,
                "rows": c.rows,
                **({"stride": c.stride} if c.stride != 1 else {}),
            }
            for c in layer.components
        ],
        "window": layer.window,
    }


# ---- layer builders: one per cache kind real models have -------------------------------------


def attention_layer(
    kv_heads: int,
    head_dim: int,
    dtype: DType,
    *,
    v_head_dim: int | None = None,
    window: int | None = None,
) -> LayerSpec:
    """Full (or, with ``window``, sliding-window) attention: K and V, sharded by KV head."""
    k = Component("k", Scope.TOKEN, (Segment("heads", kv_heads, head_dim),), dtype)
    v = Component("v", Scope.TOKEN, (Segment("heads", kv_heads, v_head_dim or head_dim),), dtype)
    kind = LayerKind.FULL if window is None else LayerKind.SLIDING
    return LayerSpec(kind, (k, v), window=window)


def mla_layer(
    kv_lora_rank: int,
    rope_dim: int,
    dtype: DType,
    *,
    indexer_dim: int | None = None,
    indexer_dtype: DType = DType.UINT8,
    window: int | None = None,
) -> LayerSpec:
    """MLA: one latent (kv_lora_rank + rope) per token, unsharded (replicated on every rank).

    With ``indexer_dim`` (DeepSeek-V3.2 sparse attention), the indexer keys of each token travel
    too, also unsharded; ``indexer_dim`` is in elements of ``indexer_dtype`` (fp8 keys plus their
    scale are usually stored together as bytes). With ``window`` (dots3's sliding MLA layers), a
    SLIDING layer that caches the latent: only the last ``window`` tokens are needed.
    """
    latent = Component(
        "latent", Scope.TOKEN, (Segment("latent", 1, kv_lora_rank + rope_dim),), dtype
    )
    if window is not None:
        if indexer_dim is not None:
            raise SpecError("a sliding MLA layer with indexer keys is not described")
        return LayerSpec(LayerKind.SLIDING, (latent,), window=window)
    if indexer_dim is None:
        return LayerSpec(LayerKind.MLA, (latent,))
    index = Component("index_k", Scope.TOKEN, (Segment("index", 1, indexer_dim),), indexer_dtype)
    return LayerSpec(LayerKind.MLA_INDEXER, (latent, index))


def mamba2_layer(
    n_heads: int,
    head_dim: int,
    n_groups: int,
    d_state: int,
    d_conv: int,
    *,
    conv_dtype: DType,
    ssm_dtype: DType,
) -> LayerSpec:
    """Mamba2: conv state over x|B|C channels, SSM state over heads.

    The conv state is ``[d_conv - 1, conv_dim]`` logically (one row per time step kept); how
    an engine orders it in memory is its memory layout's business (:class:`~kvbridge.planner.layout.
    ConvLayout`). x is sharded by head (head_dim channels each); B and C by group, replicated
    when there are fewer groups than TP ranks.
    """
    conv = Component(
        "conv",
        Scope.STATE,
        (
            Segment("x", n_heads, head_dim),
            Segment("B", n_groups, d_state),
            Segment("C", n_groups, d_state),
        ),
        conv_dtype,
        rows=conv_steps(d_conv),
    )
    ssm = Component("ssm", Scope.STATE, (Segment("heads", n_heads, head_dim * d_state),), ssm_dtype)
    return LayerSpec(LayerKind.MAMBA2, (conv, ssm))


def gdn_layer(
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    d_conv: int,
    *,
    conv_dtype: DType,
    state_dtype: DType,
) -> LayerSpec:
    """Gated delta net: conv over q|k|v channels (``[d_conv - 1, conv_dim]``, as Mamba2's),
    recurrent state over value heads."""
    conv = Component(
        "conv",
        Scope.STATE,
        (
            Segment("q", num_k_heads, head_k_dim),
            Segment("k", num_k_heads, head_k_dim),
            Segment("v", num_v_heads, head_v_dim),
        ),
        conv_dtype,
        rows=conv_steps(d_conv),
    )
    rec = Component(
        "recurrent",
        Scope.STATE,
        (Segment("v_heads", num_v_heads, head_k_dim * head_v_dim),),
        state_dtype,
    )
    return LayerSpec(LayerKind.GDN, (conv, rec))


def kda_layer(
    heads: int, head_dim: int, d_conv: int, *, conv_dtype: DType, state_dtype: DType
) -> LayerSpec:
    """Kimi delta attention: a short conv over q|k|v channels (``heads`` heads of ``head_dim``
    each, each segment sharded on its own) and a ``[head_dim, head_dim]`` recurrent state a
    head."""
    segments = tuple(Segment(name, heads, head_dim) for name in ("q", "k", "v"))
    conv = Component("conv", Scope.STATE, segments, conv_dtype, rows=conv_steps(d_conv))
    rec = Component("recurrent", Scope.STATE, (Segment("heads", heads, head_dim**2),), state_dtype)
    return LayerSpec(LayerKind.KDA, (conv, rec))


def mamba1_layer(
    intermediate: int,
    d_state: int,
    d_conv: int,
    *,
    conv_dtype: DType,
    ssm_dtype: DType,
    heads: int = 1,
) -> LayerSpec:
    """Mamba1: conv (``[d_conv - 1, intermediate]``) and SSM state (``[intermediate,
    d_state]``), sharded by channel; a multi-head Mamba1 (Zamba1's ``n_mamba_heads``: each
    head its own x and dt projections) by head, its channels being ``heads`` runs of
    ``intermediate / heads``."""
    if heads < 1 or intermediate % heads:
        raise SpecError(
            f"mamba1: {intermediate} channels do not split into {heads} heads of equal width"
        )
    name, units, width = (
        ("channels", intermediate, 1) if heads == 1 else ("heads", heads, intermediate // heads)
    )
    conv = Component(
        "conv", Scope.STATE, (Segment(name, units, width),), conv_dtype, rows=conv_steps(d_conv)
    )
    ssm = Component("ssm", Scope.STATE, (Segment(name, units, width * d_state),), ssm_dtype)
    return LayerSpec(LayerKind.MAMBA1, (conv, ssm))


def conv_steps(d_conv: int) -> int:
    # A causal conv of kernel d_conv needs the last d_conv - 1 inputs: one cached row each.
    if d_conv < 2:
        raise SpecError(f"a conv kernel of {d_conv} caches nothing; expected d_conv >= 2")
    return d_conv - 1


def short_conv_layer(hidden: int, l_cache: int, *, dtype: DType) -> LayerSpec:
    """LFM2-style gated short convolution: one conv state ``[l_cache, hidden]``, by channel."""
    conv = Component("conv", Scope.STATE, (Segment("channels", hidden, 1),), dtype, rows=l_cache)
    return LayerSpec(LayerKind.SHORT_CONV, (conv,))
