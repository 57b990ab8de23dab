"""One side of a deployment from a short text, as the command line takes it.

``tp=4,pp=2,page=64,layout=hnd`` or with an explicit PP split ``tp=2,pp=20+44``. Keys: tp, pp,
page, layout (nhd|hnd), pages (pool size; default: enough for the request twice over),
swa (separate sliding-window pool: yes|no), conv (conv-state order: sd = [state_len, dim], vLLM's
default and SGLang's; ds = [dim, state_len]; see :class:`~kvbridge.planner.layout.ConvLayout`), and
context parallelism (:mod:`kvbridge.planner.parallel`): cp (CP groups, each of tp ranks), dcp (DCP
ranks within a TP group, vLLM's decode context parallel), tokens (contiguous|zigzag|interleaved:
which shard holds each token) and interleave (tokens per turn, interleaved); dp: attention DP
groups, each an engine of its own with this layout (:mod:`kvbridge.bootstrap.groups`).

Every value is bounded, so that a typo (``page=0``, ``pages=10**12``) is refused with what was
expected before anything is sized from it; :data:`LIMITS` and :data:`MAX_TOKENS` say how far.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbridge.errors import LayoutError
from kvbridge.model.spec import CacheSpec, Scope
from kvbridge.planner.layout import (
    ConvLayout,
    KVLayout,
    build_memory,
    default_group,
    window_pool_group,
)
from kvbridge.planner.parallel import MAX_DP, MAX_TP, ParallelLayout
from kvbridge.planner.plan import Side
from kvbridge.planner.tokenmap import MAX_INTERLEAVE, MAX_SHARDS, TokenMap, TokenSplit

KEYS = (
    "tp",
    "pp",
    "page",
    "layout",
    "pages",
    "swa",
    "conv",
    "cp",
    "dcp",
    "tokens",
    "interleave",
    "dp",
)

# key -> (smallest, largest, what one counts). Generous: real engines use TP <= 64, pages of
# 1 to a few thousand tokens, pools of at most a few million pages.
LIMITS: dict[str, tuple[int, int, str]] = {
    "tp": (1, MAX_TP, "ranks"),
    "pp": (1, 1024, "stages"),
    "page": (1, 1 << 16, "tokens per page"),
    "pages": (1, 1 << 24, "pages in the pool"),
    "cp": (1, MAX_SHARDS, "context-parallel groups"),
    "dcp": (1, MAX_TP, "DCP ranks"),
    "interleave": (1, MAX_INTERLEAVE, "tokens per turn"),
    "dp": (1, MAX_DP, "attention DP groups"),
}
# A request longer than any model's context window (10M tokens at most today).
MAX_TOKENS = 1 << 24
# The planner holds a few int64 per page of a request (~0.5 GB at this bound): a request that
# spans more pages needs a larger page, not more memory.
MAX_REQUEST_PAGES = 1 << 22
_YES, _NO = ("1", "yes", "true", "on"), ("0", "no", "false", "off")
_INT = re.compile(r"[+-]?[0-9]+")


def check_count(key: str, value: object) -> int:
    """``value`` if it is an int within ``LIMITS[key]``, else a LayoutError that says so."""
    lo, hi, unit = LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{key} must be an integer ({unit}), got {value!r}")
    if not lo <= value <= hi:
        raise LayoutError(f"{key} must be in [{lo}, {hi}] ({unit}), got {value}")
    return value


def check_tokens(tokens: object) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise LayoutError(f"a request must have [1, {MAX_TOKENS}] tokens, got {tokens!r}")
    return tokens


def _int(key: str, value: str) -> int:
    if not _INT.fullmatch(value):
        raise LayoutError(f"{key} must be an integer ({LIMITS[key][2]}), got {value!r}")
    if len(value) > 20:  # int() of thousands of digits is slow, then refused: say it now
        lo, hi, unit = LIMITS[key]
        raise LayoutError(
            f"{key} must be in [{lo}, {hi}] ({unit}), got a {len(value)}-digit number"
        )
    return int(value)


@dataclass(frozen=True)
class SideOptions:
    tp: int = 1
    pp: tuple[int, ...] | int = 1  # a PP size, or the layer count of each stage
    page: int = 16
    layout: KVLayout = KVLayout.NHD
    pages: int | None = None
    swa: bool = False
    conv: ConvLayout = ConvLayout.SD
    cp: int = 1
    dcp: int = 1
    tokens: TokenSplit = TokenSplit.INTERLEAVED
    interleave: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "page", "cp", "dcp", "interleave", "dp"):
            check_count(key, getattr(self, key))
        if self.pages is not None:
            check_count("pages", self.pages)
        if isinstance(self.pp, tuple):
            if not 2 <= len(self.pp) <= LIMITS["pp"][1]:
                raise LayoutError(
                    f"a PP split needs [2, {LIMITS['pp'][1]}] stages, got {len(self.pp)}"
                )
            for n in self.pp:
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise LayoutError(f"each PP stage needs >= 1 layer, got pp={self.pp}")
        else:
            check_count("pp", self.pp)
        if not isinstance(self.layout, KVLayout):
            raise LayoutError(f"layout must be nhd or hnd, got {self.layout!r}")
        if not isinstance(self.swa, bool):
            raise LayoutError(f"swa must be yes or no, got {self.swa!r}")
        if not isinstance(self.conv, ConvLayout):
            raise LayoutError(f"conv must be sd or ds, got {self.conv!r}")
        self.parallel(self.pp if isinstance(self.pp, int) else sum(self.pp))  # cp, dcp fit tp

    @classmethod
    def parse(cls, text: str) -> SideOptions:
        """Options from ``key=value,...``; a LayoutError names the first bad item and what was
        expected of it."""
        if not isinstance(text, str) or not text.strip(" ,"):
            raise LayoutError(
                f"expected key=value pairs separated by commas (keys: "
                f"{', '.join(KEYS)}), got {text!r}"
            )
        fields: dict[str, object] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or key not in KEYS:
                raise LayoutError(f"{item!r} is not key=value with key one of {', '.join(KEYS)}")
            if key in fields:
                raise LayoutError(f"{key} is given twice")
            if key == "layout":
                if value.lower() not in ("nhd", "hnd"):
                    raise LayoutError(f"layout must be nhd or hnd, got {value!r}")
                fields[key] = KVLayout(value.lower())
            elif key == "conv":
                if value.lower() not in ("sd", "ds"):
                    raise LayoutError(
                        f"conv must be sd ([state_len, dim]) or ds ([dim, "
                        f"state_len]), got {value!r}"
                    )
                fields[key] = ConvLayout(value.lower())
            elif key == "pp" and "+" in value:
                if not all(_INT.fullmatch(v) and len(v) <= 20 for v in value.split("+")):
                    raise LayoutError(
                        f"pp={value!r}: expected a PP size or each stage's layer "
                        f"count joined by '+', like pp=20+44"
                    )
                fields[key] = tuple(int(v) for v in value.split("+"))
            elif key == "tokens":
                names = [t.value for t in TokenSplit]
                if value.lower() not in names:
                    raise LayoutError(
                        f"tokens must be one of {', '.join(names)} (which "
                        f"context-parallel shard holds each token), got {value!r}"
                    )
                fields[key] = TokenSplit(value.lower())
            elif key == "swa":
                if value.lower() not in _YES + _NO:
                    raise LayoutError(f"swa must be yes or no, got {value!r}")
                fields[key] = value.lower() in _YES
            else:
                fields[key] = check_count(key, _int(key, value))
        return cls(**fields)  # type: ignore[arg-type]

    def parallel(self, num_layers: int) -> ParallelLayout:
        if isinstance(self.pp, tuple):
            return ParallelLayout.from_split(
                self.tp,
                self.pp,
                cp=self.cp,
                dcp=self.dcp,
                split=self.tokens,
                interleave=self.interleave,
            )
        return ParallelLayout.even(
            num_layers,
            self.tp,
            self.pp,
            cp=self.cp,
            dcp=self.dcp,
            split=self.tokens,
            interleave=self.interleave,
        )

    def token_map(self) -> TokenMap:
        """Which of its token shards (``cp * dcp``) holds each token of a request."""
        return TokenMap(self.cp * self.dcp, self.tokens, self.interleave)

    def request_pages(self, tokens: int) -> int:
        """Pages a request of ``tokens`` tokens spans; a LayoutError if too many to plan."""
        need = -(-check_tokens(tokens) // self.page)
        if need > MAX_REQUEST_PAGES:
            raise LayoutError(
                f"{tokens} tokens at page={self.page} span {need} pages; at most "
                f"{MAX_REQUEST_PAGES} a request (use a larger page)"
            )
        if self.pages is not None and self.pages < need:
            raise LayoutError(
                f"pages={self.pages} holds {self.pages * self.page} tokens; the "
                f"request needs {tokens} ({need} pages of {self.page})"
            )
        return need

    def side(self, spec: CacheSpec, tokens: int) -> Side:
        need = self.request_pages(tokens)
        par = self.parallel(spec.num_layers)
        mem = build_memory(
            spec,
            par,
            page_size=self.page,
            num_pages=self.pages or 2 * need,
            kv_layout=self.layout,
            conv_layout=self.conv,
            group_of=window_pool_group if self.swa else default_group,
        )
        return Side(spec, par, mem)

    def describe(self, spec: CacheSpec) -> str:
        conv = any(
            c.rows > 1 and c.scope is Scope.STATE for layer in spec.layers for c in layer.components
        )  # the order matters only where there is one
        return (
            (f"DP{self.dp} x " if self.dp > 1 else "")
            + f"{self.parallel(spec.num_layers).describe()} page={self.page} "
            f"{self.layout.value}" + (f" conv={self.conv.value}" if conv else "")
        )
