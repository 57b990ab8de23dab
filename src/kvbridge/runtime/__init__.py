"""The request runtime: the engine (:class:`Bridge`) above a prefill half and a decode half.

==================  ========================================================================
status, timeline    a request's forward-only state with its deadlines, the decode side's
                    completion rule (``KVPoll``, ``Completion``); the moments of its phases
staging_pool        the rank's staging region, allocated and registered once
engine              :class:`Bridge`: one per rank; identity, peers, heartbeats, the transport
                    and the control channel; hands out senders and receivers
contracts           what the engine and the halves offer each other: ``Rank`` (the
                    engine's), ``RoleLogic`` (each half's)
metrics             what each rank moved and how its requests ended (Prometheus, traces)
control             the control channel (ZeroMQ), refusing malformed messages
faults              the one fault seam (test-only faults at named points; no-ops otherwise)
prefill/            ``sender`` (the sending request) -> ``jobs`` -> ``staged`` -> ``writer``
                    -> ``role`` (messages, scheduling, the worker)
decode/             ``link`` (to one prefill engine) -> ``receiver`` (the receiving request,
                    its release) -> ``landing`` (staged segments scattered) -> ``role``
==================  ========================================================================

Arrows point down: the engine imports the halves, each half imports ``contracts`` and
``faults``, and neither half imports the other or the engine.
"""

from kvbridge.runtime.decode.receiver import Receiver
from kvbridge.runtime.engine import Bridge
from kvbridge.runtime.prefill.sender import Sender

__all__ = ["Bridge", "Receiver", "Sender"]
