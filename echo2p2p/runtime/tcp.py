"""TCP congestion control for the overlay's bulk flows, chosen per socket; and the receive
low-water mark a chunk's body is read with (`echo2p2p.overlay.fetch`).

Every byte of a version leaves some uplink through a socket we open: the hub's and each peer's
chunk servers send chunks (sockets accepted from a listener inherit the listener's algorithm),
and a peer's own client sockets carry the gossip links it dials, which send pieces too. The
default here is cubic, Linux's own default, rather than whatever the machine was set to.
Measured with `bench/broadcast.py --tcp-congestion NAME` runs (8 peers, every uplink a
20 Mbit/s `tc tbf` with a 256 KiB queue, the pipelined tracker, time / (M/B), 4-5 runs each):
cubic 1.21 / 1.27 / 1.27 / 1.46, reno 1.27 / 1.30 / 1.33 / 1.45 / 1.48, BBR (this machine's
default) 1.30 / 1.34 / 1.39 / 1.46 / 1.48. Medians 1.27, 1.33 and 1.39: a small gain, inside the
run-to-run spread, so it is reported as that and not more.

Linux only lets an unprivileged process pick an algorithm in
`net.ipv4.tcp_allowed_congestion_control`; where the choice is refused, or the platform has no
TCP_CONGESTION, the socket keeps the machine's default and that is said once in the log.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
from collections.abc import Callable

from echo2p2p.errors import ConfigError

log = logging.getLogger(__name__)

_warned: set[str] = set()


def check_congestion(name: str) -> None:
    """ConfigError unless `name` could name a congestion control module ('' included)."""
    if not re.fullmatch(r"[a-z0-9_]{0,15}", name):
        raise ConfigError("tcp_congestion", f"a kernel algorithm name such as reno, cubic or "
                          f"bbr, or '' for the machine's default; got {name!r}")


def set_congestion(sock: socket.socket, name: str) -> bool:
    """Use congestion control `name` on `sock` ('' = leave the machine's default); False, and
    a warning once per name, where this machine refuses it."""
    if not name:
        return True
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except (OSError, AttributeError) as exc:
        if name not in _warned:
            _warned.add(name)
            log.warning("TCP congestion control %r refused here (%s): the overlay keeps the "
                        "machine's default", name, exc)
        return False
    return True


def set_rcvlowat(sock: socket.socket | None, nbytes: int) -> None:
    """Wake a reader of `sock` only once `nbytes` are queued (SO_RCVLOWAT; a FIN or an error
    still wakes it); nothing where the socket is gone or the platform has no such option."""
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)


def listening_socket(host: str, port: int, congestion: str) -> socket.socket:
    """A TCP listener on host:port whose accepted connections use `congestion` (they inherit
    it from the listener), for aiohttp's `web.SockSite`."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    sock = socket.create_server((host, port), family=family)
    set_congestion(sock, congestion)
    sock.setblocking(False)
    return sock


def socket_factory(congestion: str) -> Callable[[tuple], socket.socket]:
    """For `aiohttp.TCPConnector(socket_factory=...)`: client sockets using `congestion`."""
    def make(addr_info: tuple) -> socket.socket:  # one of getaddrinfo's 5-tuples
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        set_congestion(sock, congestion)
        return sock

    return make
