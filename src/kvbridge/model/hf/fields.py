"""Typed reads of a Hugging Face config dict, and what one layer caches (its mixer)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvbridge.errors import SpecError
from kvbridge.model.spec import DType

MISSING = object()
# Bounds far above any real model, so that a corrupt config is refused before anything is
# sized from it.
MAX_DIM = 1 << 24
MAX_LAYERS = 4096


class Mixer(enum.Enum):
    """What one (part of an) HF layer caches; NONE layers become no spec layer."""

    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"  # Llama 4's chunked local attention: a sliding window of the chunk
    MLA = "mla"
    MLA_INDEXER = "mla_indexer"
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GDN = "gdn"
    KDA = "kda"
    SHORT_CONV = "short_conv"
    NONE = "none"


@dataclass(frozen=True)
class Fields:
    """Typed reads of a config dict; every failure names the model type and the field."""

    raw: Mapping[str, object]
    model_type: str

    def get(self, *names: str, default: object = MISSING) -> object:
        """The first of ``names`` present and not null (aliases of one field)."""
        for n in names:
            if self.raw.get(n) is not None:
                return self.raw[n]
        if default is MISSING:
            raise self.error(names, "it is required")
        return default

    def integer(
        self, *names: str, default: int | None = None, minimum: int = 1, maximum: int = MAX_DIM
    ) -> int:
        value = self.get(*names, default=MISSING if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.error(names, f"expected an integer in [{minimum}, {maximum}], got {value!r}")
        return value

    def items(self, name: str) -> list[object]:
        value = self.get(name)
        if not isinstance(value, list):
            raise self.error((name,), f"expected a list, got {type(value).__name__}")
        return value

    def error(self, names: Sequence[str], why: str) -> SpecError:
        alias = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
        return SpecError(f"{self.model_type} config: field {names[0]!r}{alias}: {why}")


@dataclass(frozen=True)
class Ctx:
    f: Fields
    dtype: DType  # KV, latents and conv states
    ssm_dtype: DType  # Mamba2 SSM and GDN recurrent states
