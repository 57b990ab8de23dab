"""The package's shape, checked rather than kept by discipline: the runtime is two halves
under the engine (arrows point down, no circle), and no module reads another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbridge"

# Packages and modules above the runtime: they may use it; nothing below may.
ABOVE = (
    "runtime",
    "integrations",
    "cluster",
    "chaos",
    "demo",
    "bench",
    "cli",
    "__init__",
    "__main__",
)
# Private names of other projects' objects that kvbridge must read (each says why).
FOREIGN = {
    ("demo/models.py", "_attn_implementation"),  # transformers: the attention kernel in use
    ("integrations/vllm/scheduler.py", "_all_token_ids"),  # vLLM's prompt, backed off
    ("runtime/faults.py", "_exit"),  # os._exit: a fault kills the process mid-write
    ("integrations/vllm/plugin.py", "_registry"),  # vLLM's registry: registered once only
}


def modules() -> dict[str, ast.Module]:
    return {p.relative_to(SRC).as_posix(): ast.parse(p.read_text()) for p in SRC.rglob("*.py")}


def imports(tree: ast.Module) -> set[str]:
    """Every kvbridge module a module imports (TYPE_CHECKING imports included)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbridge"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvbridge")}
    return out


def layering(path: str, got: set[str]) -> list[str]:
    """The imports of module ``path`` that point up or across the runtime's halves."""
    top = path.split("/")[0].removesuffix(".py")
    banned: tuple[str, ...] = ()
    if top not in ABOVE:
        banned = ("kvbridge.runtime",)
    elif path.startswith("runtime/prefill/"):
        banned = ("kvbridge.runtime.decode", "kvbridge.runtime.engine")
    elif path.startswith("runtime/decode/"):
        banned = ("kvbridge.runtime.prefill", "kvbridge.runtime.engine")
    elif path in ("runtime/contracts.py", "runtime/faults.py", "runtime/control.py"):
        banned = ("kvbridge.runtime.prefill", "kvbridge.runtime.decode", "kvbridge.runtime.engine")
    return sorted(m for m in got if m.startswith(banned)) if banned else []


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


def test_the_runtime_is_two_halves_under_the_engine_and_nothing_below_imports_it() -> None:
    bad = {path: layering(path, imports(tree)) for path, tree in modules().items()}
    assert not {p: m for p, m in bad.items() if m}


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
    assert layering("plan.py", {"kvbridge.runtime.engine"})
    assert not layering("runtime/engine.py", {"kvbridge.runtime.decode.role"})
