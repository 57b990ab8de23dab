"""A model's config as a dict: a preset shipped with kvbridge (``kvbridge models``), a
``config.json`` file, or a model directory holding one. :func:`kvbridge.model.hf.load_spec` turns it
into a CacheSpec."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from kvbridge.errors import SpecError

_MAX_CONFIG_BYTES = 16 << 20


def _read_preset(name: str) -> str:
    presets = resources.files("kvbridge.model").joinpath("presets")
    return presets.joinpath(f"{name}.json").read_text(encoding="utf-8")


def list_presets() -> list[str]:
    """Short names of the shipped presets, e.g. ``qwen3-32b``, ``deepseek-v3``."""
    return sorted(
        p.name.removesuffix(".json")
        for p in resources.files("kvbridge.model").joinpath("presets").iterdir()
        if p.name.endswith(".json")
    )


def load_config(name_or_path: str | Path) -> dict[str, object]:
    """The raw config dict of a preset name, a ``config.json`` file, or a model directory.

    A preset name wins over a same-named relative path; write ``./name`` to mean the path.
    """
    text = str(name_or_path)
    if text in list_presets():
        source = f"preset {text!r}"
        raw = _read_preset(text)
    else:
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise SpecError(
                f"{text!r} is neither a preset nor a config.json file or model "
                f"directory; presets: {list_presets()}"
            )
        source = str(path)
        try:
            if path.stat().st_size > _MAX_CONFIG_BYTES:
                raise SpecError(
                    f"{source} is {path.stat().st_size} bytes; a model config is "
                    f"at most {_MAX_CONFIG_BYTES >> 20} MiB"
                )
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SpecError(f"cannot read {source}: {e}") from None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SpecError(f"{source} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise SpecError(f"{source} holds a {type(config).__name__}, expected a JSON object")
    return config
