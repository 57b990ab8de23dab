"""``kvbridge demo --model CONFIG``: a user's Hugging Face config, scaled down without changing
anything the transfer depends on, refused clearly where it cannot run, and run disaggregated
token-exact like the built-in models."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from kvbridge.demo.configs import case_from_config, read_config
from kvbridge.demo.matrix import _valid_tp, cells, check_topology
from kvbridge.errors import LayoutError, SpecError
from kvbridge.model.hf import spec_from_config
from kvbridge.planner.sidespec import SideOptions

PRESETS = sorted((Path(__file__).parents[1] / "src/kvbridge/model/presets").glob("*.json"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_scaling_down_keeps_every_property_the_transfer_depends_on(path: Path) -> None:
    full = spec_from_config(read_config(path))
    case = case_from_config(path)
    small = spec_from_config({"model_type": case.model_type, **case.config})
    assert [la.kind for la in small.layers] == [lb.kind for lb in full.layers]
    for a, b in zip(small.layers, full.layers, strict=True):
        assert a.window == (None if b.window is None else min(b.window, 16))
        for ca, cb in zip(a.components, b.components, strict=True):
            # heads, KV heads, groups: what decides sharding and replication
            assert [s.units for s in ca.segments] == [s.units for s in cb.segments], ca.name
            assert ca.axis_elems <= cb.axis_elems
    # ... and so exactly the same TP sizes fit, on either side.
    opts = SideOptions()
    assert _valid_tp(small, opts) == _valid_tp(full, opts)
    assert sum(c.axis_elems for la in small.layers for c in la.components) < sum(
        c.axis_elems for la in full.layers for c in la.components
    )


def test_full_size_keeps_the_config_dimensions() -> None:
    path = PRESETS[0].parent / "qwen3-8b.json"
    case = case_from_config(path, full_size=True)
    raw = read_config(path)
    assert (case.config["hidden_size"], case.config["head_dim"]) == (
        raw["hidden_size"],
        raw["head_dim"],
    )
    assert "(full size)" in case.title


def test_a_topology_the_model_cannot_take_is_refused_before_any_process_starts() -> None:
    path = str(PRESETS[0].parent / "qwen3-32b.json")  # 8 KV heads
    with pytest.raises(LayoutError) as e:
        cells(path, "tp=3->tp=1")
    assert "prefill side cannot take tp=3" in str(e.value)
    assert "TP sizes that fit this model: 1, 2, 4, 8, 16" in str(e.value)
    assert not multiprocessing.active_children()
    with pytest.raises(LayoutError, match="decode side cannot take tp=6"):
        check_topology(case_from_config(path), "tp=2->tp=6")
    assert [c.topology for c in cells(path, "tp=8->tp=16")] == ["tp=8->tp=16"]


def test_what_is_not_a_supported_model_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no model config at"):
        case_from_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SpecError, match="a config is a JSON object"):
        case_from_config(bad)
    bad.write_text(json.dumps({"model_type": "no_such_architecture", "hidden_size": 8}))
    with pytest.raises(SpecError, match="'no_such_architecture' is not an architecture"):
        case_from_config(bad)
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="not a readable JSON config"):
        case_from_config(bad)
    # A directory holding a config.json is a model too.
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        (PRESETS[0].parent / "llama-3.1-8b.json").read_text()
    )
    assert case_from_config(tmp_path / "m").name == "m"
    with pytest.raises(SpecError, match="--full-size applies to a model given as a config"):
        cells("qwen3", full_size=True)


def test_a_multimodal_config_without_its_text_config_serves_its_classs_text_model(
    tmp_path: Path,
) -> None:
    """``{"model_type": "qwen3_5"}`` (Qwen3.5's top-level config, no ``text_config``) is the
    text model transformers builds for it by default: Qwen3.5's GDN hybrid, not the wrapper's
    own fields (which hold no layers: once refused as having no recurrent heads)."""
    from kvbridge.demo.cachemap import cache_map

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_5"}))
    case = case_from_config(path)
    assert case.model_type == "qwen3_5_text"
    kinds = {layer.kind.value for layer in cache_map(case).spec.layers}
    assert kinds == {"gdn", "full"}, kinds
