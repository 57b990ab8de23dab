"""transformers config objects built once per set of fields, handed out as copies.

Why: building one runs the class's validators and attribute hooks on every field (2 ms a config
on this project's 2-core machines, ~36 s of CPU in the architecture sweep's tests, which build
the same configs again and again: the given, the scaled, each check's own); a deep copy of a
built one is ~25x cheaper. A copy, because callers set attributes on theirs and models write to
the config they are built from.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

_MAX = 512  # configs kept (a few KB each): the sweep's working set is one architecture's
_built: OrderedDict[Hashable, Any] = OrderedDict()  # key -> the config built of it
_lock = threading.Lock()


def _key(value: Any) -> Hashable:
    """``value`` as a hashable key that tells apart what a config may take differently: a list
    from a tuple, True from 1, 1 from 1.0. TypeError for what it does not know."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _key(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    raise TypeError(type(value).__name__)


def for_model(model_type: str, **fields: Any) -> Any:
    """``transformers.AutoConfig.for_model(model_type, **fields)``, from a cache: a fresh copy
    each call. What transformers refuses is raised each time, never cached."""
    from transformers import AutoConfig

    try:
        key = (model_type, _key(fields))
    except TypeError:  # a field of another type (an object): not cached
        return AutoConfig.for_model(model_type, **fields)
    with _lock:
        kept = _built.get(key)
        if kept is not None:
            _built.move_to_end(key)
    if kept is not None:
        return copy.deepcopy(kept)
    built = AutoConfig.for_model(model_type, **fields)
    with _lock:  # a copy: ``built`` holds the caller's lists, which the caller may change
        _built[key] = copy.deepcopy(built)
        if len(_built) > _MAX:
            _built.popitem(last=False)
    return built
