"""The one exception tree of kvbridge.

Every error kvbridge raises derives from :class:`KVBridgeError`; the leaves say which
contract was broken, and the message says what was expected and what came::

    KVBridgeError
    ├── SpecError            a CacheSpec that cannot exist (bad head counts, dtypes, ...)
    ├── LayoutError          a parallel or memory layout that does not fit its spec
    ├── IncompatibleError    two sides that cannot be paired (other model, other head_dim, ...)
    ├── PlacementError       a request placement out of range (page ids, slots, tokens)
    ├── ProtocolError        a malformed, unknown or out-of-version wire message
    ├── TransportError       a transport could not do what it was asked
    │   ├── TransportUnavailable   its library is not installed (names the extra)
    │   └── DeviceNotSupported     it was given CUDA device memory it cannot move (names
    │                              the transports that can)
    ├── DeviceError          CUDA device memory asked for where it cannot be served (no CUDA
    │                        here, no such device, an allocator setting that breaks IPC)
    ├── BootstrapError       the rendezvous service refused or could not be reached
    ├── ClosedError          a call on a bridge (or channel) that was closed
    └── TransferFailed       a request ended in Failed; ``reason`` is a FailureReason
"""

from __future__ import annotations

import enum


class KVBridgeError(Exception):
    """Base of every kvbridge error."""


class SpecError(KVBridgeError, ValueError):
    """A CacheSpec (or the config it was built from) is invalid."""


class LayoutError(KVBridgeError, ValueError):
    """A parallel layout or memory layout does not fit the spec."""


class IncompatibleError(KVBridgeError, ValueError):
    """The prefill and decode sides cannot be paired; the message says what differs."""


class PlacementError(KVBridgeError, ValueError):
    """A request placement (page ids, slots, token counts) is out of range."""


class ProtocolError(KVBridgeError, ValueError):
    """A wire message is malformed, unknown, or of another protocol version."""


class TransportError(KVBridgeError):
    """A transport failed to register, post or complete a transfer."""


class TransportUnavailable(TransportError, ImportError):
    """The library behind a transport is not installed."""


class DeviceNotSupported(TransportError):
    """A transport was given CUDA device memory it cannot move; refused at registration."""


class DeviceError(KVBridgeError):
    """CUDA device memory was asked for where it cannot be served: no CUDA in this process, a
    device index that does not exist, or settings under which device memory cannot be shared."""


class BootstrapError(KVBridgeError):
    """The bootstrap service refused a request or could not be reached."""


class ClosedError(KVBridgeError):
    """The bridge was closed: it takes no new request and no new chunk."""


class FailureKind(enum.Enum):
    """Why a request failed. Carried on the wire and in ``TransferFailed``."""

    DEADLINE = "deadline"  # a state's deadline passed
    PEER_DEAD = "peer_dead"  # a peer stopped heart-beating
    SENDER_ERROR = "sender_error"  # the prefill side raised while sending
    RECEIVER_ERROR = "receiver_error"  # the decode side refused or failed
    ABORTED = "aborted"  # aborted by either side
    INCOMPATIBLE = "incompatible"  # the sides cannot be paired
    BAD_INPUT = "bad_input"  # out-of-range indices or a malformed request
    INTEGRITY = "integrity"  # checksum mismatch
    TRANSPORT = "transport"  # the transport reported an error
    BOOTSTRAP = "bootstrap"  # the bootstrap service could not be used
    FENCED = "fenced"  # the other side declared this rank dead or ended the link's session
    CLOSED = "closed"  # the bridge was closed with the request still open


class TransferFailed(KVBridgeError):
    """A request ended in Failed. ``kind`` says the class of failure, the message the rest."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(f"{kind.value}: {message}")
        self.kind = kind
        self.detail = message
