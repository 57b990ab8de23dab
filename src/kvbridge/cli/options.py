"""The command line's option types: each turns one option's text into what a command uses, or
refuses it with one line saying what was expected and what came.

The checks themselves live with what takes the values (``SideOptions.parse``, ``load_spec``,
``kvbridge.config.check_host`` ...) and raise kvbridge's own errors; :class:`Checked` only
runs one at parse time, so that click names the option in the message and nothing is computed
from a bad value. Checks that exist for the command line alone (lists, the demo's prompt, a
plot's path) are here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import click

from kvbridge.config import SettingsError
from kvbridge.errors import KVBridgeError, SpecError
from kvbridge.planner.sidespec import MAX_TOKENS, check_tokens

T = TypeVar("T")
if TYPE_CHECKING:  # click >= 8.2 types ParamType by its value; older clicks are not generic
    _ParamType = click.ParamType[Any]
else:
    _ParamType = click.ParamType
MAX_PROMPT = 1024  # demo prompt bytes (= tokens); with --new-tokens, within every demo model's
MAX_NEW_TOKENS = 1024  # positions, and a few seconds of CPU per case
_INT = re.compile(r"[+-]?[0-9]{1,20}")


class Checked(_ParamType, Generic[T]):
    """An option type whose ``check(text)`` returns the value or raises a KVBridgeError."""

    def __init__(self, metavar: str, check: Callable[[str], T]) -> None:
        self.name = metavar
        self._check = check

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> T:
        if not isinstance(value, str):  # a default given as the value itself
            return value  # type: ignore[no-any-return]
        try:
            return self._check(value)
        except KVBridgeError as e:
            self.fail(str(e), param, ctx)


class Bounded(_ParamType):
    """An integer within bounds that ``bounds()`` gives when a value is parsed: the module
    owning them (chaos, bench) is imported only by the command that uses it."""

    name = "integer"

    def __init__(self, bounds: Callable[[], tuple[int, int]]) -> None:
        self._bounds = bounds

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        lo, hi = self._bounds()
        rv: int = click.IntRange(lo, hi).convert(value, param, ctx)
        return rv


def model_name(value: str) -> str:
    """``value`` if it is a preset or a readable config.json (or a directory holding one)."""
    from kvbridge.model.hf import load_spec

    try:
        load_spec(value)
    except (OSError, UnicodeDecodeError) as e:  # a path that exists but cannot be read as text
        raise SpecError(f"cannot read {value!r}: {e}") from None
    return value


def environment() -> None:
    """Refuse now, in one line, a ``KVBRIDGE_*`` variable that every rank a command starts
    would refuse on its own (each in its process, as a failed request)."""
    from kvbridge.config import Settings

    Settings.from_env()


def demo_model(value: str) -> str:
    """A demo model's name; a config.json (or a directory holding one) is left to the demo."""
    path = Path(value)
    if value.strip() and (path.is_file() or (path / "config.json").is_file()):
        return value
    from kvbridge.demo.models import get_case

    return get_case(value).name


def topology(value: str) -> str:
    from kvbridge.demo.run import parse_topology

    parse_topology(value)
    return value


def server_url(value: str) -> str:
    from kvbridge.integrations.vllm.proxy import check_url

    return check_url(value)


def bootstrap_address(value: str) -> str:
    from kvbridge.integrations.vllm.proxy import check_bootstrap

    return check_bootstrap(value)


def proxy_timeout(value: float) -> float:
    from kvbridge.integrations.vllm.proxy import check_timeout

    return check_timeout(value)


MAX_DEMO_TIMEOUT = 86400.0


def demo_timeout(value: float) -> float:
    if not (math.isfinite(value) and 1 <= value <= MAX_DEMO_TIMEOUT):
        raise SettingsError(f"must be in [1, {MAX_DEMO_TIMEOUT:.0f}] seconds, got {value}")
    return value


def prompt(value: str) -> str:
    n = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= n <= MAX_PROMPT:
        raise SettingsError(
            f"the prompt must have [1, {MAX_PROMPT}] UTF-8 bytes (its tokens), got {n}"
        )
    return value


def token_counts(value: str) -> tuple[int, ...]:
    """Comma-separated request lengths, each in [1, MAX_TOKENS]."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = next((v for v in items if not _INT.fullmatch(v)), None)
    if not items or bad is not None:
        raise SettingsError(
            f"expected comma-separated token counts in [1, {MAX_TOKENS}], got "
            f"{bad if bad is not None else value!r}"
        )
    return tuple(check_tokens(int(v)) for v in items)


def names(known: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A check for a comma-separated list of distinct names out of ``known``."""

    def check(value: str) -> tuple[str, ...]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items:
            raise SettingsError(
                f"expected comma-separated names out of {', '.join(known)}, got {value!r}"
            )
        for v in items:
            if v not in known:
                raise SettingsError(f"unknown name {v!r}; expected some of {', '.join(known)}")
            if items.count(v) > 1:
                raise SettingsError(f"{v!r} is given twice")
        return tuple(items)

    return check


def png_path(value: str) -> str:
    """A file to write: its directory must exist (checked before a long run, not after)."""
    path = Path(value)
    if not value.strip() or path.is_dir() or not path.parent.is_dir():
        raise SettingsError(f"expected a file path in an existing directory, got {value!r}")
    return value


def checked(check: Callable[[T], T]) -> Callable[[click.Context, click.Parameter, T], T]:
    """A click callback running ``check`` on a value click already converted (a host, a port,
    a timeout): the option is named in the error."""

    def callback(ctx: click.Context, param: click.Parameter, value: T) -> T:
        if value is None:
            return value
        try:
            return check(value)
        except KVBridgeError as e:
            raise click.BadParameter(str(e), ctx, param) from None

    return callback


def one_line(e: click.ClickException) -> str:
    """An error as argparse says it: ``--prefill: page must be ...`` (the caller makes it one
    line)."""
    if isinstance(e, click.BadParameter) and not isinstance(e, click.MissingParameter):
        if e.param is not None:
            return f"{'/'.join(getattr(e.param, 'opts', None) or [str(e.param.name)])}: {e.message}"
        if isinstance(e.param_hint, str):  # raised by a command naming the option itself
            return f"{e.param_hint}: {e.message}"
    return e.format_message()


# Parameter types both command modules use (kvbridge.cli, kvbridge.cli.bench).
MODEL = Checked("MODEL", model_name)
TOKENS = click.IntRange(1, MAX_TOKENS)
TOKEN_LIST = Checked("N,...", token_counts)
