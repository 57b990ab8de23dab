"""Transports: the contract (:mod:`.base`) and a registry that imports one only when chosen.

==========  ==============================================  ===========================
name        moves bytes                                     needs
==========  ==============================================  ===========================
inproc      between agents of one process (tests)           -
shm         between processes of one host, one copy         POSIX shared memory
tcp         between any hosts, over plain sockets (device   -
            memory through pinned host memory)
nixl        through a NIXL agent (UCX: RDMA, TCP, CMA,      ``pip install 'kvbridge[nixl]'``
            CUDA IPC)
mooncake    through Mooncake's Transfer Engine (TCP here)   ``pip install 'kvbridge[mooncake]'``
cudaipc     CUDA device memory between processes of one     CUDA (torch with a GPU)
            host, through CUDA IPC handles
==========  ==============================================  ===========================

inproc and shm move host memory only and refuse device memory when it is registered
(:class:`~kvbridge.errors.DeviceNotSupported`, naming the transports that take it); tcp, nixl
and mooncake take both (tcp through pinned bounce buffers: :mod:`kvbridge.memory.bounce`);
cudaipc takes device memory only.

nixl, mooncake and cudaipc import their library when an agent is created (``load_api`` in their
module), so that the package imports without them; :func:`unavailable` says why one cannot
be used here.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import TransportError, TransportUnavailable
from kvbridge.transports.base import Transport, TransportOptions, XferHandle, XferState


@dataclass(frozen=True)
class _Entry:
    module: str
    cls: str
    libraries: tuple[str, ...] = ()  # third-party top-level modules it imports
    extra: str | None = None  # the pip extra that installs them


_REGISTRY: dict[str, _Entry] = {
    "inproc": _Entry("kvbridge.transports.inproc", "InprocTransport"),
    "shm": _Entry("kvbridge.transports.shm", "ShmTransport"),
    "tcp": _Entry("kvbridge.transports.tcp", "TcpTransport"),
    "nixl": _Entry("kvbridge.transports.nixl", "NixlTransport", ("nixl",), "nixl"),
    "mooncake": _Entry(
        "kvbridge.transports.mooncake", "MooncakeTransport", ("mooncake",), "mooncake"
    ),
    "cudaipc": _Entry("kvbridge.transports.cudaipc", "CudaIpcTransport"),
}

NAMES = tuple(_REGISTRY)
DEVICE_ONLY = ("cudaipc",)  # moves CUDA device memory only
HOST_NAMES = tuple(n for n in NAMES if n not in DEVICE_ONLY)  # those that move host memory


def transport_class(name: str) -> type[Transport]:
    """The class of transport ``name``, imported now."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise TransportError(f"unknown transport {name!r}; known: {', '.join(NAMES)}")
    try:
        module = importlib.import_module(entry.module)
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if e.name == entry.module:
            hint = f" (it will need pip install 'kvbridge[{entry.extra}]')" if entry.extra else ""
            raise TransportUnavailable(
                f"transport {name!r} is reserved but not implemented in this kvbridge{hint}"
            ) from e
        if missing in entry.libraries:
            raise TransportUnavailable(
                f"transport {name!r} needs {missing!r}: pip install 'kvbridge[{entry.extra}]'"
            ) from e
        raise  # an unrelated missing module is a bug to see, not to hide
    cls: type[Transport] = getattr(module, entry.cls)
    return cls


def unavailable(name: str) -> str | None:
    """Why transport ``name`` cannot be used in this process (its library is missing or does
    not load), or None if it can."""
    try:
        loader = getattr(
            importlib.import_module(transport_class(name).__module__), "load_api", None
        )
        if loader is not None:
            loader()
    except TransportError as e:
        return str(e)
    return None


def create(
    name: str, agent: str, runtime: TransportOptions | None = None, **options: Any
) -> Transport:
    """A new agent ``agent`` of transport ``name``: the runtime's ``runtime`` options it takes
    (:meth:`~.base.Transport.options`), and its own ``options`` on top."""
    cls = transport_class(name)
    given = {**(cls.options(runtime) if runtime is not None else {}), **options}
    try:
        inspect.signature(cls).bind(agent, **given)
    except TypeError as e:  # a user's option this transport does not have: say which it has
        params = [p for p in inspect.signature(cls).parameters if p != "agent"]
        raise TransportError(f"transport {name!r}: {e}; its options are {params}") from None
    return cls(agent, **given)


__all__ = [
    "DEVICE_ONLY",
    "HOST_NAMES",
    "NAMES",
    "Transport",
    "TransportOptions",
    "XferHandle",
    "XferState",
    "create",
    "transport_class",
    "unavailable",
]
