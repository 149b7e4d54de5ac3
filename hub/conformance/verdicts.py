"""The kit's verdicts: one line per rule of the protocol spec, named by its section.

A rule is a sentence of docs/protocol/*.md that a peer can be seen to keep or break from
outside (what it sends, what its servers answer). Each gets exactly one verdict: pass, fail
(with what was seen instead) or skipped (with why the kit could not look: a leaf has no chunk
server, a check was not asked for). The report keeps them in the order they were reached and
says whether the peer conforms: it does if nothing failed (skips are not failures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The kit's phases, in order (`kit`; `--only` picks some): here, where `echo2-hub --help` may
# read them without importing the kit's aiohttp and numpy.
PHASES = ("impostor", "serving", "gossip", "dialler", "rollouts", "deltas", "reconnect")

# The rules, by spec section, in the order the kit reaches them.
HELLO = "wire §3 hello: the first frame is hello, with a 16-64 byte nonce and a 32-byte peer_key"
VERSIONS = ("wire §1a versions: the hello is framed 2 and names the peer's highest version (2 or "
            "more) and its features")
PROOF = "wire §4 handshake: a welcome whose proof fails is refused (closed, nothing used)"
JOIN = "wire §4 handshake: the peer says hello to the hub and is welcomed"
FULL = "wire §4 versions: model files and a full version fetched, verified and held"
PROBED = "wire §3 listen_addr: the advertised chunk server answers the hub's probe"
LINK_TICKET = "overlay §7a links: a dial without a ticket is refused (403)"
LINK_PROOF = "overlay §7a links: the accepting end's first frame is proof, naming the dialled peer"
LINK_PEERS = "overlay §7a peers: every entry carries the key and the hub's ticket of its id"
LINK_PIECE = "overlay §7a want: answered with the piece's exact bytes"
DIAL_SILENT = "overlay §7a links: a dialler sends nothing before the acceptor's proof"
DIAL_PROOF = "overlay §7a links: a dialler hangs up on a proof no hub of this run signed"
REPORT = "wire §3 relay_report: a corrupt piece is reported, with a reason of the spec (corrupt)"
TICKET = "overlay §7 tickets: a chunk request without a valid ticket gets 403"
CHUNK = "overlay §7 route: a ticketed chunk request gets the chunk's exact bytes"
NOT_YET = "overlay §7 route: a chunk of a manifest not seen yet is waited for, then 503"
LEASES = "wire §4 leases: the peer asks for leases and its groups are admitted"
LOGPROBS = "scoring §9 behaviour logprobs: every group spot-checked, none failed"
DELTA = "overlay §6 delta chunks: a delta of codec {codec} rebuilt and held"
RECONNECT = "wire §4 session: after a dropped connection the peer comes back with a new hello"
CLEAN = "wire §5 close codes: the hub closed the peer for no protocol error"

PASS, FAIL, SKIP = "pass", "FAIL", "skipped"


@dataclass(frozen=True)
class Verdict:
    rule: str
    outcome: str  # PASS, FAIL or SKIP
    why: str = ""  # what was seen (a failure) or why the kit could not look (a skip)

    def line(self) -> str:
        return f"{self.outcome:7s} {self.rule}" + (f": {self.why}" if self.why else "")


@dataclass
class Report:
    """The verdicts so far; `echo` prints each as it is reached (a run takes minutes)."""

    echo: bool = True
    verdicts: list[Verdict] = field(default_factory=list)

    def add(self, rule: str, ok: bool, why: str = "") -> bool:
        """A pass, or a failure saying `why`; returns `ok`."""
        self._record(Verdict(rule, PASS if ok else FAIL, "" if ok else why))
        return ok

    def skip(self, rule: str, why: str) -> None:
        self._record(Verdict(rule, SKIP, why))

    def _record(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        if self.echo:
            print(verdict.line(), flush=True)

    def has(self, rule: str) -> bool:
        return any(v.rule == rule for v in self.verdicts)

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.outcome == FAIL]

    def summary(self) -> str:
        counts = {o: sum(v.outcome == o for v in self.verdicts) for o in (PASS, FAIL, SKIP)}
        word = "conforms" if not counts[FAIL] else "does NOT conform"
        return (f"the peer {word}: {counts[PASS]} passed, {counts[FAIL]} failed, "
                f"{counts[SKIP]} skipped")
