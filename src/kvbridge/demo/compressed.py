"""DeepSeek V4's attention caches (transformers' ``DeepseekV4HCACache`` and
``DeepseekV4CSACache``), as the demo describes, reads and rebuilds them.

Each such cache layer is two spec layers: its sliding window (SLIDING, one ``kv`` component:
the keys are the values, ``keys[0, 0, t]``, the last ``sliding_window - 1`` tokens) and its
compressor's (COMPRESSED, :func:`kvbridge.model.states.compressed_layer`): per stream
(``compressor``, and for compressed sparse attention ``indexer``) the entries emitted so far
(``compressed_kv[stream][0, e]``, one every ``compress_rate`` tokens), the unclosed window's
projections and gates (``buffer_kv``, ``buffer_gate``: ``tokens % rate`` rows, padded to
``rate - 1`` in the logical tensor, the rows past them zeros) and, for CSA, the last closed
window's first series (``overlap_kv``, ``overlap_gate``; None until a window closes). What it
counts (``entry_count``, ``cumulative_length``) follows from the request's length.

torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge.model.spec import Component, DType, LayerKind, LayerSpec, Scope, Segment
from kvbridge.model.states import compressed_layer

# Component suffix -> the cache layer's dict of that name (the entries: compressed_kv).
_PARTS = {
    "": "compressed_kv",
    "_buffer": "buffer_kv",
    "_buffer_gate": "buffer_gate",
    "_overlap": "overlap_kv",
    "_overlap_gate": "overlap_gate",
}
_STREAMS = {"kv": "compressor", "index_k": "indexer"}


def is_compressed(layer: Any) -> bool:
    """Whether an HF cache layer is one of DeepSeek V4's compressed attention layers."""
    return hasattr(layer, "compress_rate") and hasattr(layer, "compressed_kv")


def specs(config: Any, layer: Any) -> list[tuple[LayerSpec, dict[str, tuple[int, ...]]]]:
    """The two spec layers of one DeepSeek V4 cache layer, and their components' shapes."""
    dim, rate = int(config.head_dim), int(layer.compress_rate)
    index = int(config.index_head_dim) if "indexer" in layer.compressed_kv else None
    kv = Component("kv", Scope.TOKEN, (Segment("kv", 1, dim),), DType.FLOAT32)
    sliding = LayerSpec(LayerKind.SLIDING, (kv,), window=int(layer.sliding_window) - 1)
    compressed = compressed_layer(rate, dim, DType.FLOAT32, indexer_dim=index)
    shapes: dict[str, tuple[int, ...]] = {
        c.name: (c.rows, c.axis_elems) for c in compressed.components
    }
    return [(sliding, {"kv": (1, dim)}), (compressed, shapes)]


def _split(name: str) -> tuple[str, str]:
    """The stream and the cache dict behind a component name."""
    for entry, stream in _STREAMS.items():
        if name.startswith(entry):
            return stream, _PARTS[name[len(entry) :]]
    raise KeyError(name)


def hf_tensors(layer: Any) -> dict[str, Any]:
    """A compressed layer's HF tensors by a readable name (batch first); the overlap of a
    stream left out until it exists."""
    out = {}
    for stream in layer.compressed_kv:
        for attr in _PARTS.values():
            held = getattr(layer, attr, {}).get(stream)
            if held is not None:
                out[f"{attr}[{stream}]"] = held
    return out


def counts(layer: Any) -> dict[str, int]:
    """A compressed layer's entry counts, by stream."""
    return {f"entry_count[{stream}]": int(n) for stream, n in layer.entry_count.items()}


def hf_shapes(shapes: Mapping[str, tuple[int, ...]], rate: int, tokens: int) -> dict[str, Any]:
    """What :func:`hf_tensors` holds after ``tokens`` tokens, from the spec's side."""
    out: dict[str, Any] = {}
    for name, (_, width) in shapes.items():
        stream, attr = _split(name)
        if attr == "compressed_kv":
            out[f"{attr}[{stream}]"] = (1, tokens // rate, width)
        elif attr.startswith("buffer"):
            out[f"{attr}[{stream}]"] = (1, tokens % rate, width)
        elif tokens >= rate:  # an overlap, once a window has closed
            out[f"{attr}[{stream}]"] = (1, rate, width)
    return out


def tensor(layer: Any, name: str, rows: int, width: int) -> Any:
    """The logical tensor of a component, without batch: the entries (one a row), or a state
    of ``rows`` rows of ``width``, the rows past those held (or all, before an overlap
    exists) zeros."""
    import torch

    stream, attr = _split(name)
    held = getattr(layer, attr)[stream]
    if attr == "compressed_kv":
        return held[0]
    out = torch.zeros((rows, width), dtype=torch.float32, device=layer.keys.device)
    if held is not None:
        out[: held.shape[1]] = held[0]
    return out


def put(layer: Any, given: dict[str, Any], tokens: int) -> None:
    """Set a compressed layer's state (``given``: each component's logical tensor, batch
    first) in a cache layer that held ``tokens`` tokens."""
    rate = int(layer.compress_rate)
    for name, t in given.items():
        stream, attr = _split(name)
        if attr == "compressed_kv":
            layer.compressed_kv[stream] = t
            layer.entry_count[stream] = tokens // rate
        elif attr.startswith("buffer"):
            getattr(layer, attr)[stream] = t[:, : tokens % rate].contiguous()
        else:
            getattr(layer, attr)[stream] = t if tokens >= rate else None
