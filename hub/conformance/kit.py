"""The conformance kit's run: a real hub, the peer under test, and the checks in order.

The kit starts a hub of its own (the built-in tiny model and addition task, gossip relay, every
group spot-checked) and runs the peer with a command line in which `{url}` stands for the
hub's websocket URL (or waits for a peer started by hand). Phases, each optional but the first:

1. join: the peer says hello through a tap (`stand_ins.Tap`), is welcomed, fetches the model
   files and a full version and holds it (JOIN, FULL).
2. impostor: before that, the same command against an impostor hub whose proof fails (HELLO,
   VERSIONS, PROOF); the peer is started again for the real hub afterwards.
3. serving, gossip: the probe (`probe.Probe`) against the peer's chunk server and /gossip.
   dialler: a second peer the kit plays (`neighbour.Neighbour`) is dialled by the peer: what
   it sends before the proof, whether it takes a bad one, how it reports a corrupt piece.
4. rollouts: leases taken, groups admitted, every group's logprobs recomputed by the hub.
5. deltas: which delta codecs the peer rebuilt (the kit's hub sends each in turn:
   `every_codec`).
6. reconnect: the tap cuts the connection; the peer must come back with a new hello.

What the kit sees of the peer it sees through the hub's own public views (`Hub.peer_views`,
`Hub.statistics`) and its log of protocol closes; it never reads the peer's memory. It assumes
the peer under test is its hub's only peer but for the kit's own neighbour.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from echo2p2p import delta
from echo2p2p import messages as m
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.counters import PeerView

from . import verdicts as v
from .neighbour import dialler_phase, neighbour
from .probe import Probe
from .stand_ins import Tap, impostor_hub

JOIN_S = 180.0  # a peer's start (imports, engine) on a loaded 2-core machine
HELD_S = 240.0
REFUSE_S = 20.0  # to hang up on an impostor once its welcome arrived
PROBED_S = 60.0
ROLLOUTS_S = 300.0
SPOT_GROUPS = 4  # spot-checked groups that make the logprob verdict
RECONNECT_S = 60.0  # the reference peer's backoff starts at 0.5 s and is capped at 30 s


def kit_config(run_dir: Path) -> HubConfig:
    """The kit's hub: small and quick, with every check on (each group spot-checked)."""
    return HubConfig.from_flat(port=0, prompts_per_step=4, group_size=4, eval_every=0,
                               run_dir=str(run_dir), torch_threads=1, seed=1,
                               spot_check_fraction=1.0, relay="gossip")


async def wait_for(condition: Callable[[], Any], timeout_s: float) -> bool:
    """Poll `condition` (the hub's views report no event) until it holds or time is up."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


class Closes(logging.Handler):
    """The hub's log of protocol closes ("closing p1: <reason>"), kept as it is written."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if (text := record.getMessage()).startswith("closing "):
            self.reasons.append(text)
        if record.levelno >= logging.WARNING:  # the logger's own propagation is off
            logging.getLogger().handle(record)


@contextlib.asynccontextmanager
async def launched(command: str | None, url: str, log_path: Path) -> AsyncIterator[None]:
    """The peer under test, started with `{url}` in `command` replaced, in a session of its
    own (stopped with its children on exit); None: print the URL for a peer started by hand."""
    if command is None:
        print(f"start the peer under test against {url}", flush=True)
        yield
        return
    with open(log_path, "ab") as out:
        proc = await asyncio.create_subprocess_shell(command.replace("{url}", url), stdout=out,
                                                     stderr=out, start_new_session=True)
    try:
        yield
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()


def impostor_welcome(hub: Any) -> m.Welcome:
    """The real hub's welcome values, its key included, with a proof it did not sign."""
    cfg = hub.core.cfg
    return m.Welcome(peer_id="p1", run_id=hub.core.run_id, model=cfg.run.model,
                     task=hub.setup.task.kind,
                     version=0, max_lag=cfg.staleness.max_lag, group_size=cfg.grpo.group_size,
                     temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p,
                     max_new_tokens=cfg.grpo.max_new_tokens, seed=1, hub_key=hub.core.hub_key,
                     ticket=bytes(64), proof=bytes(64), model_digest=hub.core.model_index[0],
                     model_signature=hub.core.model_index[1])


async def impostor_phase(run: Any, command: str, log_path: Path, report: v.Report) -> None:
    """HELLO and PROOF: the peer meets a hub that echoes the real key but cannot sign."""
    async with impostor_hub(impostor_welcome(run.hub)) as seen, \
            launched(command, seen.url, log_path):
        if not await wait_for(lambda: seen.first_type is not None, JOIN_S):
            report.add(v.HELLO, False, f"no frame within {JOIN_S:.0f} s of starting")
            report.skip(v.PROOF, "the peer sent no hello")
            return
        hello = seen.hello or {}
        nonce, key = hello.get("nonce", b""), hello.get("peer_key", b"")
        report.add(v.HELLO, seen.first_type == "hello" and isinstance(nonce, bytes)
                   and 16 <= len(nonce) <= 64 and isinstance(key, bytes) and len(key) == 32,
                   f"first frame {seen.first_type!r}, nonce of {len(nonce)} bytes, "
                   f"peer_key of {len(key)} bytes")
        if seen.hello is None:
            report.skip(v.VERSIONS, "the peer sent no hello")
            report.skip(v.PROOF, "the peer sent no hello")
            return
        framed, offers = seen.hello.get("p"), seen.hello.get("protocol", m.BASE_PROTOCOL)
        features = seen.hello.get("features", [])
        report.add(v.VERSIONS, framed == m.BASE_PROTOCOL and type(offers) is int
                   and offers >= m.BASE_PROTOCOL and isinstance(features, list)
                   and all(isinstance(f, str) for f in features),
                   f"hello framed {framed!r}, protocol {offers!r}, features {features!r}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(seen.hung_up.wait(), REFUSE_S)
        used = [t for t in seen.after_welcome if t != "goodbye"] + seen.requests
        report.add(v.PROOF, seen.hung_up.is_set() and not used,
                   f"still connected after {REFUSE_S:.0f} s" if not seen.hung_up.is_set()
                   else f"it used the impostor's welcome: {sorted(set(used))}")


def newcomer(run: Any, known: set[str]) -> str | None:
    """The id of a connected peer the kit has not seen before (the peer under test)."""
    return next((pid for pid in run.hub.peer_views() if pid not in known), None)


def view(run: Any, peer_id: str) -> PeerView | None:
    return run.hub.peer_views().get(peer_id)


async def rollouts_phase(run: Any, peer_id: str, report: v.Report) -> None:
    """LEASES and LOGPROBS: the hub recomputes every group's logprobs (fraction 1)."""
    if (pv := view(run, peer_id)) is None:
        report.add(v.LEASES, False, "the peer left before it was leased anything")
        return
    identity = pv.identity

    def judged() -> bool:
        s = run.hub.statistics()
        return s.spot_checked >= SPOT_GROUPS or s.spot_failed > 0 or identity in s.quarantined

    await wait_for(judged, ROLLOUTS_S)
    s = run.hub.statistics()
    report.add(v.LEASES, s.admitted_groups > 0,
               f"no group admitted in {ROLLOUTS_S:.0f} s; rejected: {dict(s.rejected_by)}")
    events = dict(s.trust_events.get(identity, {}))
    report.add(v.LOGPROBS, s.spot_checked > 0 and s.spot_failed == 0
               and "logprob_mismatch" not in events,
               f"{s.spot_failed} of {s.spot_checked} spot-checks failed; trust events {events}")


async def deltas_phase(run: Any, peer_id: str, probe: Probe, report: v.Report) -> None:
    """DELTA, per codec: the delta manifests the peer says it holds whole (a link's `have`
    frames), read for their chunks' codecs (overlay §6: a delta chunk opens with `E2D1` and
    the codec's index in `echo2p2p.delta.CODECS`)."""
    rules = [v.DELTA.format(codec=codec) for codec in delta.CODECS]
    pv = view(run, peer_id)
    if pv is None or not pv.server_url:
        for rule in rules:
            report.skip(rule, "a leaf: the kit reads the deltas held from a link's have frames")
        return
    await wait_for(lambda: (p := view(run, peer_id)) is None or (p.stream_version or 0) >= 3,
                   ROLLOUTS_S)
    try:
        haves = await probe.holdings(pv.server_url, peer_id)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        haves, why = [], f"no link to read its haves from: {exc or type(exc).__name__}"
    else:
        why = "no delta manifest held whole (a peer is sent deltas after its transfer_report)"
    seen: dict[str, int] = {}
    snaps = {(h.version, h.base): run.hub.core.tracker.snapshot(h.version, h.base) for h in haves
             if h.base is not None}
    whole = [h for h in haves if (snap := snaps.get((h.version, h.base))) is not None
             and sum(bin(b).count("1") for b in h.bits) == len(snap.chunks)]
    for have in whole:
        for chunk in snaps[(have.version, have.base)].chunks:
            head = bytes(chunk[:5])
            if head[:4] == b"E2D1" and head[4] < len(delta.CODECS):
                seen[delta.CODECS[head[4]]] = have.version
    if not whole:
        report.add(v.DELTA.format(codec="any"), False, why)
        return
    for codec, rule in zip(delta.CODECS, rules):
        if codec in seen:
            report.add(rule, True)
        else:
            report.skip(rule, f"no {codec} chunk in the {len(whole)} delta manifests it holds "
                        "whole (the kit's hub sends each codec in turn: too few chunks yet)")


@contextlib.contextmanager
def every_codec() -> Iterator[None]:
    """The kit's hub codes each delta chunk with the next codec in turn, where it would keep
    the smallest (`echo2p2p.delta.encode`, called from its coder threads): any codec is the
    spec's, and a peer must rebuild them all, so each is sent within a few chunks."""
    honest, turn = delta.encode, itertools.count()

    def rotating(new: Any, base: Any, *, codec: str | None = None, **kwargs: Any) -> bytes:
        codec = codec or delta.CODECS[next(turn) % len(delta.CODECS)]
        return honest(new, base, codec=codec, **kwargs)

    delta.encode = rotating
    try:
        yield
    finally:
        delta.encode = honest


async def joined(run: Any, known: set[str], report: v.Report) -> str | None:
    """JOIN and FULL: the peer under test's id once it holds a version (None: it did not)."""
    if not await wait_for(lambda: newcomer(run, known) is not None, JOIN_S):
        report.add(v.JOIN, False, f"no peer was welcomed within {JOIN_S:.0f} s")
        return None
    peer_id = newcomer(run, known)
    known.add(peer_id)
    report.add(v.JOIN, True)
    def holds(pv: PeerView | None) -> bool:  # version_held, after transfer_report
        return pv is not None and pv.held_version is not None and pv.stream_version is not None

    await wait_for(lambda: (pv := view(run, peer_id)) is None or holds(pv), HELD_S)
    pv = view(run, peer_id)
    return peer_id if report.add(v.FULL, holds(pv), "the peer left" if pv is None else
                                 f"within {HELD_S:.0f} s: held {pv.held_version}, "
                                 f"reported whole {pv.stream_version}") else None


async def serving_phases(run: Any, peer_id: str, probe: Probe, phases: set[str],
                         report: v.Report) -> None:
    """PROBED, then the probe's checks of the chunk route and of a gossip link."""
    pv = view(run, peer_id)
    if pv is None or not pv.server_url:
        why = "a leaf (no listen_addr): no chunk server to check"
        for rule in (v.PROBED, v.LINK_TICKET, v.LINK_PROOF, v.LINK_PEERS, v.LINK_PIECE,
                     v.TICKET, v.CHUNK, v.NOT_YET):
            report.skip(rule, why)
        return
    await wait_for(lambda: (p := view(run, peer_id)) is None or p.relay != "unprobed", PROBED_S)
    relay = p.relay if (p := view(run, peer_id)) is not None else "(the peer left)"
    report.add(v.PROBED, relay in ("ok", "slow"), f"the hub's probe of {pv.server_url}: {relay}")
    if "gossip" in phases:
        await probe.gossip_link(report, pv.server_url, peer_id)
    if "serving" in phases:
        held = (view(run, peer_id) or pv).stream_version or 0
        keys = [*probe.held_keys, (held, held - 1), (held, None)]
        await probe.chunk_route(report, pv.server_url, peer_id, keys)


async def check(command: str | None, phases: set[str], work_dir: Path, report: v.Report) -> None:
    """Run the kit: every rule of `phases` (and the join, first version and close-code rules)
    gets its verdict in `report`."""
    from echo2p2p.hub.run.start import start_hub  # torch: after argument parsing

    closes = Closes()
    server_log = logging.getLogger("echo2p2p.hub.serving.server")
    server_log.addHandler(closes)
    server_log.setLevel(logging.INFO)
    server_log.propagate = False
    log_path = work_dir / "peer.log"
    try:
        with every_codec():  # each delta codec sent in turn (the hub would keep one)
            async with start_hub(kit_config(work_dir / "run"), stream=None) as run, \
                    aiohttp.ClientSession() as http:
                if "impostor" in phases and command is not None:
                    await impostor_phase(run, command, log_path, report)
                elif "impostor" in phases:
                    for rule in (v.HELLO, v.VERSIONS, v.PROOF):
                        report.skip(rule, "the peer was started by hand (--peer starts it twice)")
                async with Tap(run.port) as tap, \
                        launched(command, f"ws://127.0.0.1:{tap.port}/ws", log_path):
                    await _joined_phases(run, tap, Probe(run.hub, run.signing_key, http), phases,
                                         report)
                s = run.hub.statistics()
                report.add(v.CLEAN, s.closed_for_protocol == 0,
                           f"{s.closed_for_protocol} closes: {closes.reasons[:3]}")
    finally:
        server_log.removeHandler(closes)
        server_log.propagate = True
    if report.failed and command is not None:
        print(f"the peer's output: {log_path}", flush=True)


async def _joined_phases(run: Any, tap: Tap, probe: Probe, phases: set[str],
                         report: v.Report) -> None:
    known: set[str] = set()
    if (peer_id := await joined(run, known, report)) is None:
        return
    if phases & {"serving", "gossip"}:
        await serving_phases(run, peer_id, probe, phases, report)
    if "dialler" in phases:
        async with neighbour(probe.http, f"ws://127.0.0.1:{run.port}/ws") as nb:
            known.add(nb.peer_id)
            await dialler_phase(run.hub, peer_id, nb, report)
    if "rollouts" in phases:
        await rollouts_phase(run, peer_id, report)
    if "deltas" in phases:
        await deltas_phase(run, peer_id, probe, report)
    if "reconnect" in phases:
        tap.drop()
        back = await wait_for(lambda: newcomer(run, known) is not None, RECONNECT_S)
        report.add(v.RECONNECT, back, f"no new hello within {RECONNECT_S:.0f} s of the drop")
