"""The package's shape, checked rather than kept by discipline: the top level is its layers,
each importing only those before it (arrows point down, no circle); the runtime is two halves
under the engine; no module reads another's private names or is over 500 lines; the
architecture page names every module; what moved still imports from where it was."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvbridge import _new_path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbridge"

# The top level, in the order data flows: each package (and entry file) imports only those
# before it. errors.py and config.py are the two entry files beside the packages: the one
# exception tree (every layer raises it), and the one settings table (it names staging's
# modes, so comes after staging; the layers after it read it).
LAYERS = (
    "errors",
    "model",
    "planner",
    "memory",
    "staging",
    "config",
    "wire",
    "transports",
    "bootstrap",
    "runtime",
    "integrations",
    "deploy",
    "chaos",
    "demo",
    "bench",
    "cli",
    "__init__",
    "__main__",
)
TOP = frozenset(LAYERS[:-2])  # what kvbridge.X may name
# Inside a layer whose modules are floors, each imports only the floors before it.
FLOORS = {
    "planner": (
        "shard",
        "tokenmap",
        "parallel",
        "layout",
        "placement",
        "runs",
        "transferplan",
        "pieces",
        "side",
        "pairitems",
        "plan",
        "reference",
        "sidespec",
    ),
    "memory": ("location", "pools", "device", "copy", "integrity"),
}
# Private names of other projects' objects that kvbridge must read (each says why).
FOREIGN = {
    ("demo/models.py", "_attn_implementation"),  # transformers: the attention kernel in use
    ("integrations/vllm/scheduler.py", "_all_token_ids"),  # vLLM's prompt, backed off
    ("runtime/faults.py", "_exit"),  # os._exit: a fault kills the process mid-write
    ("integrations/vllm/plugin.py", "_registry"),  # vLLM's registry: registered once only
    ("chaos/ranks.py", "_current_frames"),  # sys: each thread's stack, a hung request's evidence
    # A server forked from the fork server ends as an interpreter would (its exit handlers
    # run) and never returns into the fork server's loop.
    ("integrations/forkserver.py", "_run_exitfuncs"),
    ("integrations/forkserver.py", "_exit"),
}


def modules() -> dict[str, ast.Module]:
    return {p.relative_to(SRC).as_posix(): ast.parse(p.read_text()) for p in SRC.rglob("*.py")}


def imports(tree: ast.Module) -> set[str]:
    """Every kvbridge module a module imports (TYPE_CHECKING imports included); ``from
    kvbridge import x`` counts as ``kvbridge.x`` where x is a package or module, and a
    relative import as ``relative``, which kvbridge's modules never use."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            out.add("relative")
        elif isinstance(node, ast.ImportFrom) and node.module == "kvbridge":
            out |= {f"kvbridge.{a.name}" for a in node.names if a.name in TOP}
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbridge")
        ):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvbridge")}
    return out


def _top(module: str) -> str:
    return module.split(".")[1] if module.startswith("kvbridge.") else ""


def layering(path: str, got: set[str]) -> list[str]:
    """The imports of module ``path`` that point up: to a later layer, to a later floor of
    its own layer, or across the runtime's halves; and any import not of a layer's module
    (a relative import, an old path that moved)."""
    parts = path.removesuffix(".py").split("/")
    rank = LAYERS.index(parts[0])
    bad = [m for m in got if _top(m) not in TOP or _new_path(m) is not None]
    bad += [m for m in got if _top(m) in TOP and LAYERS.index(_top(m)) > rank]
    floors = FLOORS.get(parts[0], ())
    if len(parts) == 2 and parts[1] in floors:
        later = floors[floors.index(parts[1]) + 1 :]
        bad += [m for m in got if m.startswith(tuple(f"kvbridge.{parts[0]}.{f}" for f in later))]
    banned: tuple[str, ...] = ()
    if path.startswith("runtime/prefill/"):
        banned = ("kvbridge.runtime.decode", "kvbridge.runtime.engine")
    elif path.startswith("runtime/decode/"):
        banned = ("kvbridge.runtime.prefill", "kvbridge.runtime.engine")
    elif path in ("runtime/contracts.py", "runtime/faults.py", "runtime/control.py"):
        banned = ("kvbridge.runtime.prefill", "kvbridge.runtime.decode", "kvbridge.runtime.engine")
    return sorted(set(bad) | {m for m in got if banned and m.startswith(banned)})


def private_reads(path: str, tree: ast.Module) -> list[str]:
    """``x._name`` (x not self or cls) where this module does not define ``_name`` itself
    (another instance of its own class may be read) and no FOREIGN entry allows it."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    bad = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr not in own and (path, node.attr) not in FOREIGN:
            bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_each_layer_imports_only_those_before_it_and_the_runtime_is_two_halves() -> None:
    bad = {path: layering(path, imports(tree)) for path, tree in modules().items()}
    assert not {p: m for p, m in bad.items() if m}


def test_the_top_level_holds_only_the_layers_and_the_entry_files() -> None:
    top = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.name not in ("py.typed",)}
    top.discard("__pycache__")
    assert top == set(LAYERS)
    assert all((SRC / p / "__init__.py").exists() for p in top if (SRC / p).is_dir())


def test_no_module_is_over_500_lines() -> None:
    long = {p: n for p in modules() if (n := len((SRC / p).read_text().splitlines())) > 500}
    assert not long


def test_no_module_reads_another_modules_private_names() -> None:
    bad = [line for path, tree in modules().items() for line in private_reads(path, tree)]
    assert not bad, "\n".join(bad)


def test_the_checks_see_what_they_forbid() -> None:
    """Negative controls: a writer reading its sender's lock and chunks, a decode module
    importing the prefill half, a planner module importing the runtime."""
    writer = ast.parse("def transfer(s):\n    with s._lock:\n        return s._chunks\n")
    assert len(private_reads("runtime/prefill/writer.py", writer)) == 2
    mine = ast.parse(
        "class A:\n    def __init__(self):\n        self._x = 1\n"
        "    def same(self, other):\n        return other._x\n"
    )
    assert private_reads("runtime/prefill/a.py", mine) == []
    assert layering("runtime/decode/role.py", {"kvbridge.runtime.prefill.sender"})
    assert layering("planner/plan.py", {"kvbridge.runtime.engine"})
    assert layering("planner/layout.py", {"kvbridge.planner.plan"})
    assert not layering("planner/plan.py", {"kvbridge.planner.layout", "kvbridge.model.spec"})
    assert layering("config.py", {"kvbridge.bootstrap.server"})
    assert layering("memory/pools.py", {"kvbridge.memory.copy"})
    assert layering("planner/plan.py", {"relative"})  # from ..runtime import x
    assert layering("planner/plan.py", {"kvbridge.runtime"})  # from kvbridge import runtime
    assert layering("runtime/engine.py", {"kvbridge.staging.pool"})  # an old path
    assert layering("runtime/engine.py", {"kvbridge.layout"})
    assert imports(ast.parse("from kvbridge import runtime, Bridge")) == {"kvbridge.runtime"}
    assert imports(ast.parse("from ..runtime import engine")) == {"relative"}
    assert not layering("runtime/engine.py", {"kvbridge.runtime.decode.role"})


def test_every_moved_module_still_imports_from_its_old_path() -> None:
    """What users imported before the layer packages (2026-11-27) is the same module now,
    with a warning naming the new path; a path that never existed is still refused."""
    import importlib
    import sys
    import warnings

    import kvbridge

    for old, new in kvbridge._MOVED.items():
        if old == "plan":  # the planner's function too: aliased without the finder
            continue
        sys.modules.pop(f"kvbridge.{old}", None)  # an alias another test made: made again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"kvbridge.{old}")
        assert module is importlib.import_module(f"kvbridge.{new}")
        assert module.__spec__ is not None and module.__spec__.name == f"kvbridge.{new}"
        assert [str(w.message) for w in caught] == [f"kvbridge.{old} moved to kvbridge.{new}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fields = importlib.import_module("kvbridge.hf.fields")
    assert fields is importlib.import_module("kvbridge.model.hf.fields")
    # kvbridge.plan is the planner's function, and the old module path its module.
    assert sys.modules["kvbridge.plan"] is importlib.import_module("kvbridge.planner.plan")
    assert callable(kvbridge.plan)
    from kvbridge.memory import HostPool  # the old module is a package: its names re-exported

    assert HostPool.__module__ == "kvbridge.memory.pools"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvbridge.no_such_module")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvbridge.layout.nope")


@pytest.mark.slow  # two interpreters
def test_an_old_path_runs_as_a_command_as_its_new_one_does() -> None:
    import subprocess
    import sys

    old = subprocess.run(
        [sys.executable, "-W", "always", "-m", "kvbridge.configref"], capture_output=True, text=True
    )
    new = subprocess.run([sys.executable, "-m", "kvbridge.cli.configref"], capture_output=True)
    assert old.returncode == 0, old.stderr
    assert old.stdout.encode() == new.stdout and new.stdout.startswith(b"# Configuration")
    assert "kvbridge.configref moved to kvbridge.cli.configref" in old.stderr


def test_the_architecture_page_names_every_module_under_its_layer_in_order() -> None:
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    sections = re.findall(
        r"^### \d+\. `(\w+)(?:/|\.py)`\n(.*?)(?=^### |^## |\Z)", page, re.M | re.S
    )
    assert [name for name, _ in sections] == list(LAYERS[:-2])
    listed = {
        p: layer for layer, text in sections for p in re.findall(r"^- `([\w/]+\.py)`", text, re.M)
    }
    named = {p for p in modules() if not p.endswith("__init__.py") and p.count("/")}
    assert set(listed) == named  # every module, and no module that is gone
    assert all(p.split("/")[0] == layer for p, layer in listed.items())


SERVER_STARTERS = {"serve", "served", "tp2_to_tp1", "router"}  # of the tests' server helpers


def _starts_servers(tree: ast.Module) -> bool:
    """The module calls a function of the tests' server helpers (sglang_servers, vllm_servers)
    or of an integration's launch module that starts an engine server or a router."""
    helpers = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("sglang_servers", "vllm_servers")
        for a in node.names
        if a.name in SERVER_STARTERS
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in helpers:
            return True
        if (
            isinstance(f, ast.Attribute)
            and f.attr in SERVER_STARTERS
            and isinstance(f.value, ast.Name)
            and f.value.id == "launch"
        ):
            return True
    return False


def test_every_module_that_starts_engine_servers_runs_in_the_engines_group() -> None:
    """Two such modules at once on the two workers stall each other's engines
    (tests/conftest.py): each must be in ENGINE_MODULES."""
    from conftest import ENGINE_MODULES

    tests = Path(__file__).parent
    starting = {
        p.stem for p in tests.glob("test_*.py") if _starts_servers(ast.parse(p.read_text()))
    }
    assert starting <= ENGINE_MODULES, sorted(starting - ENGINE_MODULES)
    assert {"test_sglang_backend", "test_vllm_tp"} <= starting  # the check sees them
