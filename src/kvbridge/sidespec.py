"""One side of a deployment from a short text, as the command line takes it.

``tp=4,pp=2,page=64,layout=hnd`` or with an explicit PP split ``tp=2,pp=20+44``. Keys: tp, pp,
page, layout (nhd|hnd), pages (pool size; default: enough for the request twice over),
swa (separate sliding-window pool: yes|no).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import LayoutError
from kvbridge.layout import KVLayout, build_memory, default_group, window_pool_group
from kvbridge.parallel import ParallelLayout
from kvbridge.plan import Side
from kvbridge.spec import CacheSpec

KEYS = ("tp", "pp", "page", "layout", "pages", "swa")


@dataclass(frozen=True)
class SideOptions:
    tp: int = 1
    pp: tuple[int, ...] | int = 1
    page: int = 16
    layout: KVLayout = KVLayout.NHD
    pages: int | None = None
    swa: bool = False

    @classmethod
    def parse(cls, text: str) -> SideOptions:
        fields: dict[str, object] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in KEYS:
                raise LayoutError(f"side option {item!r}: expected key=value with key one of "
                                  f"{', '.join(KEYS)}")
            try:
                if key == "layout":
                    fields[key] = KVLayout(value.lower())
                elif key == "pp":
                    parts = tuple(int(v) for v in value.split("+"))
                    fields[key] = parts if len(parts) > 1 else parts[0]
                elif key == "swa":
                    fields[key] = value.lower() in ("1", "yes", "true", "on")
                else:
                    fields[key] = int(value)
            except ValueError:
                raise LayoutError(f"side option {key}={value!r} is not valid; expected "
                                  f"{'nhd or hnd' if key == 'layout' else 'an integer'}") from None
        return cls(**fields)  # type: ignore[arg-type]

    def parallel(self, num_layers: int) -> ParallelLayout:
        if isinstance(self.pp, tuple):
            return ParallelLayout.from_split(self.tp, self.pp)
        return ParallelLayout.even(num_layers, self.tp, self.pp)

    def side(self, spec: CacheSpec, tokens: int) -> Side:
        par = self.parallel(spec.num_layers)
        pages = self.pages or max(1, 2 * -(-tokens // self.page))
        mem = build_memory(spec, par, page_size=self.page, num_pages=pages, kv_layout=self.layout,
                           group_of=window_pool_group if self.swa else default_group)
        return Side(spec, par, mem)

    def describe(self, num_layers: int) -> str:
        return f"{self.parallel(num_layers).describe()} page={self.page} {self.layout.value}"
