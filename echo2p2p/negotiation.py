"""Negotiation: which protocol version and optional features one connection uses.

Each side speaks a range of protocol versions and a set of optional features (`Speaks`), as
BitTorrent's extension handshake and HTTP/2's SETTINGS do. The side that opens says the newest
version it speaks and its features (a peer's `hello`, always framed with `BASE_PROTOCOL`; a
gossip dialler's upgrade headers, `PROTOCOL_HEADER` and `FEATURES_HEADER`); the other answers
with what the connection uses (`Speaks.answer`): the lower of the two newest versions, and the
features both speak (a name it does not know is ignored). An opener whose newest version is
older than the answerer's oldest is refused with one sentence the user can act on
(`refusal`); an answer the opener cannot speak is refused on its side (`Speaks.check`). No
answer at all (an older release: no `protocol` in its welcome, no header) means version 2 and
no features. Every frame after the answer carries the version agreed.

Within a version only optional additions are made (a field with a default older readers
ignore, a new feature name); a new required field or frame, or a changed meaning, is a new
version. Knows no sockets and no messages: numbers and names in, an `Agreed` out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import RemoteProtocolError
from .frames import BASE_PROTOCOL, CLOSE_BAD_PROTOCOL_VERSION, SUPPORTED_PROTOCOLS

# Optional behaviour a hub <-> peer connection may use (protocol 3). "leaf-notice": the hub
# says in the welcome whether it deals this peer a share (`Welcome.leaf`), and the peer tells
# its user it is a leaf; without it the welcome's `leaf` stays false (not told).
LEAF_NOTICE = "leaf-notice"
FEATURES = frozenset({LEAF_NOTICE})
LINK_FEATURES: frozenset[str] = frozenset()  # none yet on gossip links: the header says so
PROTOCOL_HEADER = "Echo2-Protocol"  # in a gossip upgrade: the dialler's newest, the agreed one
FEATURES_HEADER = "Echo2-Features"  # comma-separated feature names, likewise
MAX_FEATURES = 32  # feature names a side names: a hello past it is refused, a header's rest ignored


@dataclass(frozen=True)
class Agreed:
    """What one connection uses: its protocol version and the optional features both speak."""

    protocol: int
    features: tuple[str, ...] = ()


def refusal(ours: int, theirs: int, us: str = "hub", them: str = "peer") -> str:
    """The one sentence an opener too old for us is refused with (close 4000)."""
    return (f"this {us} speaks protocol {ours}; this {them} speaks {theirs}: "
            f"upgrade with pip install -U echo2p2p")


@dataclass(frozen=True)
class Speaks:
    """What one side speaks: protocol versions and optional feature names."""

    protocols: tuple[int, ...] = SUPPORTED_PROTOCOLS
    features: frozenset[str] = FEATURES

    @property
    def newest(self) -> int:
        return max(self.protocols)

    def answer(self, theirs: int, features: Iterable[str], us: str = "hub",
               them: str = "peer") -> Agreed:
        """What a connection opened by a side whose newest version is `theirs`, speaking
        `features`, uses. RemoteProtocolError (4000, `refusal`'s sentence) if we speak no
        version it does."""
        use = min(theirs, self.newest)
        if use not in self.protocols:
            raise RemoteProtocolError(refusal(self.newest, theirs, us, them),
                                      CLOSE_BAD_PROTOCOL_VERSION)
        return Agreed(use, tuple(sorted(self.features.intersection(features))))

    def check(self, protocol: int, features: Iterable[str]) -> Agreed | None:
        """The answer we opened with got (`protocol`, `features`) as we use it: None if we do
        not speak that version; features we did not offer are ignored."""
        if protocol not in self.protocols:
            return None
        return Agreed(protocol, tuple(sorted(self.features.intersection(features))))

    def cannot_speak(self, protocol: int, other: str) -> str:
        """The sentence for an answer in a version we do not speak."""
        ours = (f"{min(self.protocols)} to {self.newest}" if len(self.protocols) > 1
                else str(self.newest))
        fix = ("upgrade with pip install -U echo2p2p" if protocol > self.newest
               else "its operator must upgrade it (pip install -U echo2p2p)")
        return f"{other} speaks protocol {protocol}; this peer speaks {ours}: {fix}"


SPEAKS = Speaks()  # this release, hub <-> peer (its newest is PROTOCOL_VERSION)
LINK_SPEAKS = Speaks(SPEAKS.protocols, LINK_FEATURES)  # this release, on gossip links


def read_header(protocol: str | None, features: str | None) -> tuple[int, list[str]] | None:
    """An upgrade's `PROTOCOL_HEADER` and `FEATURES_HEADER` values as (version, names): absent
    is (2, []); None if the version is not a plain positive number (a header no release sends)."""
    if protocol is None:
        return BASE_PROTOCOL, []
    if not (protocol.isascii() and protocol.isdigit() and 0 < len(protocol) <= 5):
        return None
    names = [n.strip() for n in (features or "").split(",")[:MAX_FEATURES]]
    return int(protocol), [n for n in names if n]


def features_header(features: Iterable[str]) -> str:
    """`FEATURES_HEADER`'s value for `features`."""
    return ",".join(sorted(features))
