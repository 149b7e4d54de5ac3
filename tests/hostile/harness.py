"""A real training hub in-process with one honest peer, and what the suite measures of them:
whether the hub still serves, whether the honest peer still trains after an attack began, and
the records the hub wrote (quarantines, relay reports).

The hub and the honest peer (a real `PeerClient` with the real CPU engine) run on the test's
event loop; an attacker whose cost is measured as a rate runs in a process of its own
(`attacker_process`, tests/hostile/attacks.py), the others on the same loop. Waits are on
events (the hub's and the honest peer's: `until`, `peer_until`), never on polls or sleeps;
nothing here asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.run.start import start_hub
from echo2p2p.hub.run.loop import HubRun
from echo2p2p.peer.client import PeerClient

from tests.conftest import peer_until, running_peers, until, wait_first

HONEST = "test-0"  # running_peers' name for the first peer
START_STEPS = 2  # learner steps taken before an attack begins: training is under way
AFTER_STEPS = 5  # learner steps that must follow the attack for "the honest peer still trains"


def small_cfg(tmp_path: Path, **overrides: Any) -> HubConfig:
    """The hub of most attacks: built-in model and task, 4 prompts x 4 samples a step, no
    evaluation, running until the test is done (max_steps 0) unless told otherwise."""
    cfg = HubConfig.from_flat(port=0, prompts_per_step=4, group_size=4, eval_every=0, eval_problems=32,
                    run_dir=str(tmp_path / "run"), torch_threads=1, seed=1)
    return cfg.replace(**overrides)


def steps(run: HubRun) -> int:
    """Learner steps taken so far."""
    return sum(1 for r in run.records if "step" in r)


async def wait_steps(run: HubRun, n: int, timeout_s: float) -> None:
    """Return once the learner has taken `n` steps (the hub's step, as `finish_step` counts)."""
    await until(run.hub, lambda: run.hub.core.step >= n, timeout_s)


async def until_finished_or(run: HubRun, condition, timeout_s: float) -> None:
    """Return once the run has finished or `condition()` holds (looked at after each event
    of the hub's); an assertion error after `timeout_s`."""
    await wait_first(run.finished.wait(), until(run.hub, condition, timeout_s),
                     timeout_s=timeout_s)


def peer_id(run: HubRun, name: str) -> str:
    """The hub's id for the connected peer called `name` (what an attacker learns from the
    sources of a relay plan)."""
    ids = [pid for pid, conn in run.hub.peer_views().items() if conn.name == name]
    assert len(ids) == 1, f"{len(ids)} peers named {name!r}"
    return ids[0]


@contextlib.asynccontextmanager
async def hub_and_honest_peer(cfg: HubConfig, **peer_overrides: Any
                              ) -> AsyncIterator[tuple[HubRun, PeerClient]]:
    """A training hub and one honest peer, once START_STEPS learner steps were taken."""
    async with start_hub(cfg, stream=None) as run, \
            running_peers(run.url, 1, torch_threads=1, **peer_overrides) as [honest]:
        await wait_steps(run, START_STEPS, 120)
        yield run, honest


@dataclass(frozen=True)
class Mark:
    """Where training stood when an attack began."""

    steps: int
    acked: int
    loaded: int


def mark(run: HubRun, honest: PeerClient) -> Mark:
    s = honest.statistics()
    return Mark(steps(run), s.acked, s.versions_loaded)


async def still_training(run: HubRun, honest: PeerClient, since: Mark,
                         n_steps: int = AFTER_STEPS) -> str:
    """Wait for `n_steps` learner steps after `since`, with a rollout of the honest peer's
    admitted and a new version loaded by it meanwhile; the table's account of it."""

    def going() -> bool:  # each count only grows: waited on one by one, they hold together
        s = honest.statistics()
        return s.acked > since.acked and s.versions_loaded > since.loaded

    await until(run.hub, lambda: steps(run) >= since.steps + n_steps, 120)
    await peer_until(honest, going, 120)
    s = honest.statistics()
    return (f"yes: {steps(run) - since.steps} steps, {s.acked - since.acked} groups acked, "
            f"{s.versions_loaded - since.loaded} versions loaded since")


async def steps_per_min(run: HubRun, n_steps: int = 3, timeout_s: float = 180.0) -> float:
    """Learner steps per minute over the next `n_steps` steps, by the wall clock: the figure of
    the suite table's "steps/min without / with the attacker" column, measured in one run
    (before the attack, then during it). Never asserted: these machines are noisy."""
    first = run.hub.statistics().step
    start = time.monotonic()
    await wait_steps(run, first + n_steps, timeout_s)
    return 60.0 * (run.hub.statistics().step - first) / (time.monotonic() - start)


def cell_rate(without: float, with_: float, after: float | None = None) -> str:
    """The table's steps/min cell: "without / with" (and " / after", once it left)."""
    return f"{without:.1f} / {with_:.1f}" + (f" / {after:.1f}" if after is not None else "")


REPO = Path(__file__).resolve().parents[2]


class AttackerProcess:
    """An attacker running in a process of its own (`tests.hostile.attacks`): `report` is the
    last line of counts it printed."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.report: dict[str, Any] = {}
        self._pulse = asyncio.Event()

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.report = json.loads(line)
                self._pulse.set()
                self._pulse = asyncio.Event()

    async def wait_report(self, condition, timeout_s: float = 60.0) -> dict[str, Any]:
        """The first report (counts) for which `condition(report)` holds."""
        async with asyncio.timeout(timeout_s):
            while not condition(self.report):
                assert self.proc.returncode is None, f"the attacker ended: {self.report}"
                await self._pulse.wait()
        return self.report


def family(report: dict[str, Any], name: str) -> dict[str, int]:
    """The counts of one family in an attacker's report, by what they name: its keys
    "<name>: <what>" (tests/hostile/peer_attacks.py's `fast: <tell>`, `slow: <peer id>`, ...)."""
    prefix = f"{name}: "
    return {k[len(prefix):]: v for k, v in report.items() if k.startswith(prefix)}


@contextlib.asynccontextmanager
async def attacker_process(kind: str, url: str, **params: Any) -> AsyncIterator[AttackerProcess]:
    """`tests.hostile.attacks` KIND against `url` in a process of its own, stopped (SIGTERM,
    then killed) on exit; its final counts are in `report` afterwards."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.hostile.attacks", kind, url, json.dumps(params),
        cwd=REPO, stdout=asyncio.subprocess.PIPE)
    attacker = AttackerProcess(proc)
    reader = asyncio.create_task(attacker._read())
    try:
        yield attacker
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        await reader


@dataclass(frozen=True)
class Rates:
    """Learner steps a minute of one hub before, during and after an attack."""

    without: float
    with_: float
    after: float

    @property
    def loss(self) -> float:
        """What the attack cost, as a fraction of the rate before and after it (the mean of
        the two: a hub that speeds up as it warms makes "before" alone look worse)."""
        return 1.0 - self.with_ / ((self.without + self.after) / 2)

    def cell(self) -> str:
        return cell_rate(self.without, self.with_, self.after) + f" ({self.loss:+.0%} lost)"


async def hub_alive(run: HubRun) -> bool:
    """The hub's /status answers, for this run. (The hub is in-process: had its task group
    died, as the transfer report and price bombs made it, the test would end in that error.)"""
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http, \
                http.get(f"http://127.0.0.1:{run.port}/status") as resp:
            return resp.status == 200 and (await resp.json())["run_id"] == run.hub.core.run_id
    except (aiohttp.ClientError, TimeoutError):
        return False


def run_events(run: HubRun, kind: str) -> list[dict[str, Any]]:
    """The run log's records of one event kind (quarantine, propagation, ...)."""
    path = Path(run.runlog.run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("event") == kind]


@dataclass(frozen=True)
class Caught:
    """What became of a liar that ran beside the honest peer for a whole run."""

    liar: str  # its identity
    honest: str  # the honest peer's
    events: dict[str, int]  # the liar's trust events
    quarantined_at: int | None  # the step of its quarantine, if any


async def run_beside(run: HubRun, liar: PeerClient, timeout_s: float) -> Caught:
    """Run `liar` until the hub's run finishes (its max_steps), then what the hub held of it."""
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(liar.run(stop))
        try:
            await asyncio.wait_for(run.finished.wait(), timeout_s)
            liar_identity = run.hub.peer_views()[peer_id(run, liar.cfg.name)].identity
            honest_identity = run.hub.peer_views()[peer_id(run, HONEST)].identity
        finally:
            stop.set()
    caught = [q["step"] for q in run_events(run, "quarantine") if q["identity"] == liar_identity]
    return Caught(liar_identity, honest_identity, run.hub.statistics().trust_events.get(liar_identity, {}),
                  caught[0] if caught else None)
