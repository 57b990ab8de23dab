"""What kvbridge's test-only stand-ins (sgl_kernel, torchvision; see README.md here) share.

A stand-in package imports, and so does any submodule of it whatever its name (SGLang and
transformers import ``torchvision.io``, ``torchvision.transforms.v2.functional`` and others while
loading a model's config). Importing also needs names: on its CPU path SGLang runs ``from
sgl_kernel import copy_all_layer_kv_cache_cpu`` at import time, and transformers runs ``from
torchvision.transforms import InterpolationMode`` and builds a table of
``InterpolationMode.BICUBIC`` and its siblings. So a name read from a stand-in is an inert
StandInObject (and so is a name read from that), and every *use* of one (calling it,
truth-testing, iterating, indexing, comparing its order, isinstance, subclassing, setting an
attribute) raises a RuntimeError that names the stand-in and what was asked of it: a code path
that really needs the package fails where it starts instead of computing something else.

Dunder names raise AttributeError as usual: the import system and inspect, copy or pickle probe
them (``__path__``, ``__wrapped__``) and read AttributeError as "absent".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _refuse(qualname: str, what: str) -> NoReturn:
    top = qualname.split(".")[0]
    raise RuntimeError(
        f"{qualname} was {what}, but this {top!r} is kvbridge's TEST-ONLY stand-in "
        f"(tests/sglang_standins/{top}, put into the SGLang test venv by scripts/sglang_env.sh): "
        f"it can be imported and does nothing else. Whatever needs {qualname} needs the real "
        f"{top}, which has no CPU build here."
    )


def _lookup(qualname: str) -> Any:
    """The stand-in object (or module) named ``qualname``, as unpickling finds it."""
    top, *names = qualname.split(".")
    obj: Any = importlib.import_module(top)
    for name in names:
        obj = getattr(obj, name)
    return obj


class StandInObject:
    """A name read from a stand-in: it can be held, hashed and printed, and nothing else."""

    __slots__ = ("_standin_name", "_standin_children")

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_standin_name", qualname)
        object.__setattr__(self, "_standin_children", {})

    def __getattr__(self, name: str) -> StandInObject:
        if _is_dunder(name):
            raise AttributeError(name)
        children: dict[str, StandInObject] = object.__getattribute__(self, "_standin_children")
        if name not in children:  # the same object each time, as a real attribute would be
            children[name] = StandInObject(f"{self._standin_name}.{name}")
        return children[name]

    def __repr__(self) -> str:
        return f"<kvbridge test-only stand-in {self._standin_name}>"

    # Copies and pickles (a config copied, or sent to a scheduler subprocess) are the same
    # inert name again, looked up anew where it is unpickled.
    def __copy__(self) -> StandInObject:
        return self

    def __deepcopy__(self, memo: Any) -> StandInObject:
        return self

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _lookup, (self._standin_name,)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        _refuse(f"{self._standin_name}.{name}", "assigned")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(self._standin_name, "called")

    def __bool__(self) -> NoReturn:
        _refuse(self._standin_name, "truth-tested")

    def __len__(self) -> NoReturn:
        _refuse(self._standin_name, "measured (len)")

    def __iter__(self) -> NoReturn:
        _refuse(self._standin_name, "iterated")

    def __contains__(self, item: Any) -> NoReturn:
        _refuse(self._standin_name, "searched (in)")

    def __getitem__(self, key: Any) -> NoReturn:
        _refuse(self._standin_name, "indexed")

    def __index__(self) -> NoReturn:
        _refuse(self._standin_name, "used as an integer")

    def __lt__(self, other: Any) -> NoReturn:
        _refuse(self._standin_name, "compared (<)")

    def __le__(self, other: Any) -> NoReturn:
        _refuse(self._standin_name, "compared (<=)")

    def __gt__(self, other: Any) -> NoReturn:
        _refuse(self._standin_name, "compared (>)")

    def __ge__(self, other: Any) -> NoReturn:
        _refuse(self._standin_name, "compared (>=)")

    def __instancecheck__(self, instance: Any) -> NoReturn:
        _refuse(self._standin_name, "used as a type (isinstance)")

    def __subclasscheck__(self, subclass: Any) -> NoReturn:
        _refuse(self._standin_name, "used as a type (issubclass)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> NoReturn:
        _refuse(self._standin_name, "subclassed")


class StandInModule(types.ModuleType):
    """A module of a stand-in package: a name it was not given is a StandInObject."""

    def __getattr__(self, name: str) -> Any:
        if _is_dunder(name):
            raise AttributeError(name)
        submodule = sys.modules.get(f"{self.__name__}.{name}")
        if submodule is not None:
            return submodule
        obj = StandInObject(f"{self.__name__}.{name}")
        setattr(self, name, obj)  # the same object each time
        return obj


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every ``<top>.<anything>`` as an empty StandInModule package."""

    def __init__(self, top: str) -> None:
        self.top = top

    def find_spec(
        self,
        fullname: str,
        path: Any = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.top + "."):
            return None
        # A package (with an empty __path__), so that deeper submodules import too.
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def stand_in(module_name: str) -> None:
    """Turn the (already executing) top-level package ``module_name`` into a stand-in."""
    if not any(isinstance(f, _SubmoduleFinder) and f.top == module_name for f in sys.meta_path):
        sys.meta_path.append(_SubmoduleFinder(module_name))
    sys.modules[module_name].__class__ = StandInModule
