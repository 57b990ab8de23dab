"""A fixed delay on the packets a host receives, without netem: the kernel queues them to user
space (iptables' NFQUEUE target) and this process gives each back (accepts it) ``delay`` after
it arrived, in arrival order.

These machines' kernel has no netem and no nft ``queue`` statement, but it has nfnetlink_queue
and the xt NFQUEUE target (measured on these hosts: ``tc qdisc add ... netem`` fails, an
``iptables -j NFQUEUE`` rule works): one ``iptables`` rule in the host's
namespace sends its incoming packets to queue N, and this module speaks the nfnetlink_queue
protocol over a netlink socket itself (no library to build). Only packet ids travel (copy mode
META): the payload stays in the kernel.

Run inside the host's namespace (``python -m kvbridge.deploy.linkdelay QUEUE DELAY_MS``, as
:meth:`kvbridge.deploy.netns.Network.delay` does); it prints ``ready`` once bound, and runs until
killed. A delay at both ends of a link is a round-trip delay of twice it.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
SUBSYS_QUEUE = 3
MSG_PACKET, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 2, 3
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN = 1, 2, 3
CMD_BIND = 1
COPY_META = 1
PACKET_HDR, VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NETLINK_NO_ENOBUFS = 5
SOL_NETLINK = 270
_HDR = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, port id


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + attrs
    return _HDR.pack(_HDR.size + len(body), (SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """The packet ids of the queued-packet messages in one netlink read."""
    ids, at = [], 0
    while at + _HDR.size <= len(data):
        length, kind, _, _, _ = _HDR.unpack_from(data, at)
        if length < _HDR.size:
            break
        if kind == (SUBSYS_QUEUE << 8) | MSG_PACKET:
            pos, end = at + _HDR.size + 4, at + length  # past nfgenmsg
            while pos + 4 <= end:
                alen, akind = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if akind & 0x7FFF == PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += (alen + 3) & ~3
        elif kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, at + _HDR.size)
            if err:
                raise OSError(-err, f"nfnetlink_queue refused a request: error {-err}")
        at += (length + 3) & ~3
    return ids


def bind(queue: int) -> socket.socket:
    """A netlink socket bound to nfnetlink_queue ``queue``, copying packet ids only."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE: bursts of packet ids
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    config = [
        _attr(CFG_CMD, struct.pack("!BBH", CMD_BIND, 0, socket.AF_INET)),
        _attr(CFG_PARAMS, struct.pack("!IB", 0, COPY_META)),
        _attr(CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16)),
    ]
    for attr in config:
        sock.send(_message(MSG_CONFIG, queue, attr, NLM_F_REQUEST | NLM_F_ACK))
        _packet_ids(sock.recv(4096))  # the acknowledgement, or the kernel's error
    return sock


def hold(sock: socket.socket, queue: int, delay: float) -> None:
    """Accept every packet ``delay`` seconds after it was queued, in order, forever."""
    pending: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        wait = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        if select.select([sock], [], [], wait)[0]:
            now = time.monotonic()
            for pid in _packet_ids(sock.recv(1 << 20)):
                pending.append((now + delay, pid))
        now, last = time.monotonic(), None
        while pending and pending[0][0] <= now:
            last = pending.popleft()[1]
        if last is not None:  # one batch verdict accepts every packet up to this id
            sock.send(_message(MSG_VERDICT_BATCH, queue, _attr(VERDICT_HDR, _verdict(last))))


def _verdict(packet_id: int) -> bytes:
    return struct.pack("!II", NF_ACCEPT, packet_id)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kvbridge.deploy.linkdelay QUEUE DELAY_MS", file=sys.stderr)
        return 2
    queue, delay = int(argv[0]), float(argv[1]) / 1000
    sock = bind(queue)
    print("ready", flush=True)
    hold(sock, queue, delay)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
