"""docs/configuration.md is exactly what the code renders now, and names everything a user can
set: so the reference cannot drift from the defaults and meanings written in the code."""

import re
from dataclasses import fields
from pathlib import Path

from kvbridge.cli.configref import COMMAND, render
from kvbridge.config import ENV_PREFIX, OTHER_VARIABLES, Settings
from kvbridge.integrations.vllm.params import ConnectorOptions

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
# A variable's name as the code and the scripts spell it (the bare prefix is no variable).
VARIABLE = re.compile(r"\bKVBRIDGE_[A-Z][A-Z0-9_]*\b")


def test_the_page_is_what_the_code_renders() -> None:
    assert PAGE.read_text() == render(), f"docs/configuration.md is stale; run: {COMMAND}"


def test_every_setting_is_on_the_page_with_its_variable() -> None:
    page = PAGE.read_text()
    for f in fields(Settings):
        assert f"| `{ENV_PREFIX}{f.name.upper()}` | `{f.name}` |" in page, f.name


def test_every_connector_option_is_on_the_page() -> None:
    page = PAGE.read_text()
    for f in fields(ConnectorOptions):
        assert f"| `{f.name}` |" in page, f.name


def test_every_variable_the_code_reads_is_on_the_page() -> None:
    # The package and the scripts a user runs; a name merely quoted in a message counts too.
    sources = [*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").glob("*.sh")]
    named = {name for path in sources for name in VARIABLE.findall(path.read_text())}
    assert {v.name for v in OTHER_VARIABLES} <= named, "a documented variable nothing reads"
    page = PAGE.read_text()
    missing = sorted(name for name in named if f"| `{name}` |" not in page)
    assert not missing, f"read by the code but not in docs/configuration.md: {missing}"
