"""Congestion control per socket: listeners hand it to the connections they accept."""

from __future__ import annotations

import logging
import socket

import pytest

from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.peer.config import PeerConfig
from echo2p2p.runtime.tcp import check_congestion, listening_socket, set_congestion, socket_factory


def _algorithm(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def test_connections_accepted_from_the_listener_use_its_algorithm():
    """A listener set to reno accepts reno connections, whatever the machine's default."""
    with listening_socket("127.0.0.1", 0, "reno") as listener:
        listener.setblocking(True)
        with socket.create_connection(listener.getsockname()) as client:
            accepted, _ = listener.accept()
            with accepted:
                assert _algorithm(accepted) == "reno"
                assert _algorithm(client) == _algorithm(socket.socket())  # the default


def test_client_sockets_from_the_factory_use_the_algorithm():
    """The aiohttp socket factory's sockets are non-blocking and use the chosen algorithm."""
    info = socket.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM)[0]
    with socket_factory("reno")(info) as sock:
        assert _algorithm(sock) == "reno" and not sock.getblocking()


def test_an_algorithm_this_machine_lacks_keeps_the_default_and_says_so(caplog):
    """An unknown module is refused by the kernel: False, one warning, default kept."""
    with socket.socket() as sock, caplog.at_level(logging.WARNING):
        default = _algorithm(sock)
        assert not set_congestion(sock, "nosuchalgo")
        assert not set_congestion(sock, "nosuchalgo")
        assert _algorithm(sock) == default
    assert sum("nosuchalgo" in r.message for r in caplog.records) == 1
    assert set_congestion(socket.socket(), "")  # '' asks for nothing


@pytest.mark.parametrize("make", [lambda v: PeerConfig(hub_url="ws://h:1/ws", tcp_congestion=v),
                                  lambda v: HubConfig.from_flat(tcp_congestion=v)])
@pytest.mark.parametrize("bad", ["Reno", "re no", "x" * 16, "bbr;rm"])
def test_a_name_that_cannot_be_an_algorithm_is_a_config_error(make, bad):
    """A bad name fails at start, naming the field."""
    with pytest.raises(ConfigError, match="tcp_congestion"):
        make(bad)
    check_congestion("cubic")
