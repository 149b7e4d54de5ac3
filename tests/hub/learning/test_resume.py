"""Hub restart without loss: the journal, the checkpoint, the peer's outbox, and a resumed run.

The SIGKILL version, with real processes, is tests/chaos/; here the pieces, and a whole hub
stopped and resumed in this process with real peers on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgpack
import torch

from echo2p2p import messages as m
from echo2p2p.hub.learning.durable import Checkpoints, read_journal
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.outbox import Outbox

from tests.conftest import peer_until, until


def submission(lease_id: str, version: int = 0, tokens: int = 8) -> m.RolloutSubmission:
    sample = m.Sample(m.pack_ids(list(range(tokens))), m.pack_logprobs([-0.5] * tokens), "7",
                      1.0, "stop")
    return m.RolloutSubmission(lease_id, version, [sample, sample])


def test_an_admitted_group_survives_the_journal():
    """A group's rows go through the journal's msgpack record and come back equal (float32
    logprobs round-trip exactly)."""
    import msgpack

    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.hub.learning.durable import group_from_wire, group_to_wire
    from echo2p2p.rows import parse_samples

    rows = parse_samples([m.Sample(m.pack_ids([3, 9, 1]), m.pack_logprobs([-0.1, -2.5e-7, 0.0]),
                                   "x", 1.0, "stop"),
                          m.Sample(m.pack_ids([4]), m.pack_logprobs([-0.3]), "y", 0.0, "length")],
                         None)
    group = ScoredGroup("L7", "p3", [5, 6], 2, rows, [1.0, 0.0])
    wire = msgpack.unpackb(msgpack.packb(group_to_wire(group), use_bin_type=True), raw=False)
    assert group_from_wire(wire) == group


def test_a_torn_last_journal_record_is_skipped(tmp_path):
    """A kill in the middle of an append leaves a partial record: every whole one is read."""
    ckpt = Checkpoints(tmp_path)
    journal = ckpt.journal(0)
    for i in range(5):
        journal.write(["lease", "grant", f"L{i}", i, 0, False])
    journal.close()
    whole = (tmp_path / "checkpoints" / "journal-000000.log").read_bytes()
    partial = msgpack.packb(["admit", ["L9", "p", [1, 2], 0, [], []]])[:-3]
    (tmp_path / "checkpoints" / "journal-000000.log").write_bytes(whole + partial)
    records = list(read_journal(tmp_path / "checkpoints" / "journal-000000.log"))
    assert [r[2] for r in records] == [f"L{i}" for i in range(5)]


def test_a_checkpoint_replaces_the_previous_one_atomically(tmp_path):
    """LATEST names the newest whole checkpoint; older checkpoints and journals are deleted,
    journals from the current one on are kept and read back in order."""
    ckpt = Checkpoints(tmp_path)
    for number in range(3):
        ckpt.journal(number).write(["lease", "requeue", f"L{number}", number])
        def save(where, number=number):  # a learner's directory, as Learner.save writes one
            where.mkdir()
            torch.save({"w": torch.full((3,), float(number))}, where / "state.pt")
        ckpt.write(number, save, {"step": number})
    ckpt.journal(3).write(["lease", "requeue", "L3", 3])  # a checkpoint that never finished
    learner, hub, journal = ckpt.load()
    saved = torch.load(learner / "state.pt")
    assert ckpt.latest() == 2 and hub == {"step": 2} and torch.equal(saved["w"], torch.full((3,), 2.0))
    assert [r[2] for r in journal] == ["L2", "L3"]
    assert sorted(p.name for p in ckpt.root.iterdir()) == \
        ["LATEST", "ckpt-000002", "journal-000002.log", "journal-000003.log"]
    assert ckpt.next_number() == 4


def test_outbox_spills_to_disk_resends_in_order_and_stays_bounded(tmp_path):
    one = len(m.encode(submission("L0")))
    box = Outbox(memory_bytes=2 * one, max_entries=4, spool_dir=str(tmp_path))
    for i in range(5):
        box.put(submission(f"L{i}", version=i))
    assert box.spilled_total == 3 and len(box) == 4  # L0 dropped: the bound
    assert [s.lease_id for s in box.pending()] == ["L1", "L2", "L3", "L4"]
    assert box.pending()[2] == submission("L3", version=3)  # bytes on disk decode back whole
    box.pop("L3")
    assert box.drop_newer_than(2) == 1 and [s.lease_id for s in box.pending()] == ["L1", "L2"]
    spool = next(tmp_path.iterdir())
    assert [f.name for f in spool.iterdir()] == ["2-L2.msgpack"]  # L3, L4 went with their files
    box.close()
    assert not spool.exists()


async def test_a_resumed_hub_continues_where_it_stopped(hub_cfg):
    """Weights, optimizer, version, leases, the data cursor and every admitted-but-untrained
    group come back; the resumed run trains on, never on a group it trained before the stop;
    the peer's rollouts made while the hub was away are sent again and admitted."""
    cfg = hub_cfg.replace(max_steps=3, lease_timeout_s=600)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        async with start_hub(cfg, stream=None) as run:
            peer = PeerClient(PeerConfig(hub_url=run.url, name="stays", reconnect_max_s=0.5,
                                         torch_threads=1, leases_in_flight=4))
            running = tg.create_task(peer.run(stop))
            await asyncio.wait_for(run.finished.wait(), 120)
            weights = {k: v.clone() for k, v in run.learner.model.state_dict().items()}
            trained_before = {lid for r in run.records if "step" in r for lid in r["rollout/leases"]}
            await until(run.hub, lambda: run.hub.statistics().queued_groups >= 1)
        # the hub is gone (closed as at shutdown); what it admitted since its checkpoint is in
        # the journal, and what the peer made since is in the peer's outbox
        queued = {g.lease_id for g in run.hub.statistics().queue}
        drawn = run.hub.statistics().drawn_problems
        async with start_hub(cfg.replace(max_steps=6, port=run.port), stream=None,
                             resume=True) as run2:
            assert run2.hub.core.step == 3 and run2.hub.statistics().newest_version == 3  # one step counter
            assert all(torch.equal(weights[k], v) for k, v in run2.learner.model.state_dict().items())
            assert {g.lease_id for g in run2.hub.statistics().queue} >= queued
            await asyncio.wait_for(run2.finished.wait(), 120)
            await peer_until(peer, lambda: len(peer.outbox) == 0)
        stop.set()
        await running
    log = [json.loads(line) for line in (Path(cfg.run.run_dir) / "metrics.jsonl").open()]
    resumed = [r for r in log if r.get("event") == "resume"]
    assert len(resumed) == 1 and resumed[0]["version"] == 3
    assert resumed[0]["drawn_problems"] == drawn  # the data cursor, before the peer drew more
    footprint = [r for r in log if r.get("event") == "footprint"]  # predicted at each start
    assert len(footprint) == 2 and footprint[0]["checkpoint_every"] == 1  # the tiny model's
    assert footprint[0]["predicted_ram_bytes"] > 16 * footprint[0]["params"] > 0
    trained_after = [lid for r in run2.records if "step" in r for lid in r["rollout/leases"]]
    assert [r["step"] for r in run2.records if "step" in r] == [3, 4, 5]
    assert not trained_before & set(trained_after)
    assert len(trained_after) == len(set(trained_after))
    assert peer.statistics().connections == 2


async def test_a_stopped_run_checkpoints_its_step_and_a_resumed_one_goes_on_from_it(hub_cfg):
    """`HubRun.stop()` (what SIGINT and SIGTERM call) ends the learner loop after its step and
    checkpoints that step: no step is trained after it, though a batch is waiting. Resumed, the
    run's clock (`time_s`, the resume record's) and its totals (admitted, stale, rejected by
    reason, trained lags, the reward workers') go on from the checkpoint's, never below what
    was logged before."""
    from echo2p2p.hub.view.run_data import read_run
    from echo2p2p.hub.view.report import summary

    cfg = hub_cfg.replace(max_steps=0, max_lag=1, lease_timeout_s=600)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        async with start_hub(cfg, stream=None) as run:
            peer = PeerClient(PeerConfig(hub_url=run.url, name="stays", reconnect_max_s=0.5,
                                         torch_threads=1, leases_in_flight=8))
            running = tg.create_task(peer.run(stop))
            await until(run.hub, lambda: run.hub.core.step >= 2, 120)
            assert await run.stop()
            stopped_at, logged = run.hub.core.step, run.records[-1]
            # a batch waits, and no step takes it
            batch = cfg.grpo.prompts_per_step
            await until(run.hub, lambda: run.hub.statistics().queued_groups >= batch)
            assert run.hub.core.step == stopped_at and not run.finished.is_set()
            assert run.records[-1]["step"] + 1 == stopped_at
            trained_lags = dict(run.runlog.staleness)
        _, state, _ = Checkpoints(Path(cfg.run.run_dir)).load()
        assert state["step"] == stopped_at and state["loop"]["time_s"] >= run.records[-1]["time_s"]
        async with start_hub(cfg.replace(max_steps=stopped_at + 2, port=run.port), stream=None,
                             resume=True) as run2:
            resumed, saved = run2.hub.statistics(), state["totals"]["counters"]
            assert resumed.admitted_groups >= saved["admitted_groups"] >= \
                logged["rollout/admitted_groups_total"] > 0
            assert resumed.stale_on_arrival >= saved["stale_on_arrival"]
            assert resumed.rejected_by.items() >= saved["rejected_by"].items()
            assert resumed.stale_in_queue == state["totals"]["buffer"]["dropped"]
            assert resumed.scoring.completions == state["totals"]["scorer"]["completions"] > 0
            assert run2.runlog.staleness == trained_lags
            await asyncio.wait_for(run2.finished.wait(), 120)
        stop.set()
        await running
    log = [json.loads(line) for line in (Path(cfg.run.run_dir) / "metrics.jsonl").open()]
    steps = [r for r in log if "event" not in r]
    assert [r["step"] for r in steps] == list(range(stopped_at + 2))  # each step once
    resume = next(r for r in log if r.get("event") == "resume")
    assert resume["time_s"] == round(state["loop"]["time_s"], 3)
    for key in ("time_s", "rollout/admitted_groups_total", "rollout/stale_on_arrival_total",
                "rollout/stale_in_queue_total", "rollout/rejected_total"):
        assert all(a[key] <= b[key] for a, b in zip(steps, steps[1:])), key
    assert steps[stopped_at]["time_s"] >= resume["time_s"]
    data = read_run(Path(cfg.run.run_dir))  # the report: one run, its clock the last step's
    assert data.elapsed_s[-1] == steps[-1]["time_s"]
    rows, last = dict(summary(data)), steps[-1]
    assert rows["dropped stale (on arrival / in queue)"] == \
        f"{last['rollout/stale_on_arrival_total']} / {last['rollout/stale_in_queue_total']}"


def test_the_hubs_totals_survive_a_checkpoint():
    """Every counter and histogram goes through the checkpoint's msgpack and comes back."""
    from collections import Counter

    from echo2p2p.hub.serving.counters import Counters

    counters = Counters(admitted_groups=7, admitted_samples=28, stale_on_arrival=2, rejected=1,
                        relay_reports=Counter({("p1", "bad_chunk"): 2}),
                        stale_lags=Counter({3: 2}), rejected_by=Counter({"stale": 2, "bad": 1}))
    wire = msgpack.unpackb(msgpack.packb(counters.state(), use_bin_type=True), raw=False,
                           strict_map_key=False)
    restored = Counters()
    restored.restore(wire)
    assert restored == counters


def test_resume_without_a_run_or_a_checkpoint_says_so(tmp_path, capsys):
    from echo2p2p.hub.cli import main

    assert main(["serve", "--resume", str(tmp_path / "nowhere")]) == 1
    assert "no run to resume" in (err := capsys.readouterr().err) and "no such directory" in err
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "x", "port": 0}))
    assert main(["serve", "--resume", str(tmp_path)]) == 1
    assert "no checkpoint in" in capsys.readouterr().err
    assert (tmp_path / "config.json").is_file()  # a failed resume never removes the run's files
