"""The conformance kit, run as a third party would: `python -m echo2p2p.hub.conformance` in a
process of its own, with a real hub, the peer under test in another process and real sockets.
It passes our reference peer and fails each broken peer of `tests.conformance.broken` on the
rule that peer breaks, by name."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from echo2p2p.hub.conformance import main, verdicts as v

from .broken import BROKEN

REPO = Path(__file__).resolve().parents[2]
PEER_OPTIONS = "join {url} --torch-threads 1 --listen 127.0.0.1:0"
ALL_RULES = [v.HELLO, v.VERSIONS, v.PROOF, v.JOIN, v.FULL, v.PROBED, v.LINK_TICKET,
             v.LINK_PROOF, v.LINK_PEERS, v.LINK_PIECE, v.DIAL_SILENT, v.DIAL_PROOF, v.REPORT,
             v.TICKET, v.CHUNK, v.NOT_YET, v.LEASES, v.LOGPROBS, v.RECONNECT, v.CLEAN]


def kit(tmp_path: Path, peer_module: str, only: str = "") -> tuple[int, list[str]]:
    """Run the kit against `python -m peer_module ...`; its exit status and output lines."""
    peer = f"{shlex.quote(sys.executable)} -m {peer_module} {PEER_OPTIONS}"
    argv = [sys.executable, "-m", "echo2p2p.hub.conformance", "--work-dir", str(tmp_path),
            "--peer", peer, *(["--only", only] if only else [])]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout.splitlines()


@pytest.mark.system
def test_the_reference_peer_conforms(tmp_path):
    """Every rule passes (or is skipped with a reason) on echo2-peer; exit status 0."""
    rc, lines = kit(tmp_path, "echo2p2p.peer.cli")
    assert rc == 0, "\n".join(lines)
    assert not [line for line in lines if line.startswith("FAIL")]
    for rule in ALL_RULES:  # each judged, passed or skipped (a skip says why)
        assert any(line[8:].startswith(rule) for line in lines if not line.startswith("FAIL")), rule
    assert any(line.startswith("pass") and "overlay §6 delta chunks" in line for line in lines)


@pytest.mark.system
@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_peer_fails_the_rule_it_breaks(tmp_path, kind):
    """A peer with one behaviour changed fails, naming the rule: exit status 1, a FAIL line."""
    _, phase, rule = BROKEN[kind]
    rc, lines = kit(tmp_path, f"tests.conformance.broken {kind}", only=phase)
    assert rc == 1, "\n".join(lines)
    assert any(line.startswith(f"FAIL    {rule}") for line in lines), "\n".join(lines)


def test_unknown_phase_is_refused(capsys):
    """A phase the kit does not have is refused before anything starts (exit status 2)."""
    assert main(["--only", "gossip,teleport"]) == 2
    assert "teleport" in capsys.readouterr().err


def test_report_fails_on_any_failure_and_not_on_skips():
    """Skips are not failures; one failure makes the peer not conform."""
    report = v.Report(echo=False)
    report.add(v.JOIN, True)
    report.skip(v.CHUNK, "a leaf")
    assert not report.failed and "conforms: 1 passed, 0 failed, 1 skipped" in report.summary()
    report.add(v.LOGPROBS, False, "2 of 4 spot-checks failed")
    assert [f.rule for f in report.failed] == [v.LOGPROBS]
    assert report.failed[0].line() == f"FAIL    {v.LOGPROBS}: 2 of 4 spot-checks failed"
