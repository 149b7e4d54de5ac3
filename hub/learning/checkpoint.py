"""What a checkpoint keeps of the hub and how the hub comes back to it (`echo2p2p.hub.learning.durable`
writes the files; the learner's weights are the trainer's).

`hub_state` is the hub as plain data: run id, step, the next peer number, the lease table and
data cursor, every admitted group not yet trained on (with the identity that sent it), trust, and
the run's totals (the hub's counters, the queue's stale drops, the cost meter, the reward
workers' counts). `restore_hub` puts a state and the journal written after it back into a fresh
hub's core (`hub.core.core.HubCore`: its step, peer numbers, lease book, buffer, trust book,
counters and pool) and scorer; the groups the journal admits
count as admitted again (the checkpoint's totals did not have them). Groups the learner can no
longer train on are kept: the staleness rule drops them when a batch is taken. Groups withdrawn
(their peer was quarantined) stay out.
`checkpoint_due` is the cadence: by version count, and by the run's clock (passed in).
No sockets, no clock (`now` is an argument), no files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .durable import group_from_wire, group_to_wire

if TYPE_CHECKING:
    from echo2p2p.scoring.scorer import Scorer

    from ..core.core import HubCore


def hub_state(core: HubCore, scorer: Scorer | None, now: float) -> dict[str, Any]:
    """What a checkpoint keeps of the hub, as plain data (`scorer`: the hub's, if any)."""
    leases, buffer, trust, counters, pool = (core.leases, core.buffer, core.trust, core.counters,
                                             core.pool)
    return {"run_id": core.run_id, "step": core.step, "next_peer": core.next_peer,
            "leases": leases.state(),
            "buffer": [group_to_wire(g) for g in buffer.groups()],
            "sources": buffer.sources(),
            "trust": trust.state(),
            "totals": {"counters": counters.state(), "buffer": buffer.totals(),
                       "pool": pool.totals(now), "scorer": scorer.totals() if scorer else {}}}


def restore_hub(state: dict[str, Any], journal: list[list], core: HubCore, scorer: Scorer | None,
                now: float) -> None:
    """Come back to `state` plus the `journal` after it: the step, the lease table, the data
    cursor, every admitted group not yet trained on, trust, the totals, and the next peer number
    (a resumed hub never hands out a peer id again)."""
    leases, buffer, trust, counters, pool = (core.leases, core.buffer, core.trust, core.counters,
                                             core.pool)
    core.step, next_peer = state["step"], state["next_peer"]
    leases.restore(state["leases"], now)
    sources = state.get("sources", {})  # absent from checkpoints before withdrawals
    for wire in state["buffer"]:
        group = group_from_wire(wire)
        buffer.put(group, sources.get(group.lease_id, ""))
    trust.restore(state["trust"])
    if totals := state.get("totals"):  # absent from checkpoints before the totals were kept
        counters.restore(totals["counters"])
        buffer.restore_totals(totals["buffer"])
        pool.restore_totals(totals["pool"])
        if scorer is not None:
            scorer.restore_totals(totals.get("scorer", {}))
    for kind, *record in journal:
        if kind == "lease":
            leases.replay(tuple(record), now)
        elif kind == "peer":
            next_peer = max(next_peer, record[0])
        elif kind == "admit":  # (group, source); the source absent from journals before it
            group = group_from_wire(record[0])
            leases.replay(("done", group.lease_id), now)
            buffer.put(group, record[1] if len(record) > 1 else "")
            counters.admitted_groups += 1
            counters.admitted_samples += len(group.samples)
            pool.admitted_left += len(group.samples)
        elif kind == "withdraw":
            counters.withdrawn_groups += len(buffer.remove(set(record[0])))
    core.next_peer = next_peer


def checkpoint_due(published: int, now_s: float, last_s: float | None, *, every: int,
                   every_s: float) -> bool:
    """Whether the publication of the `published`-th version (0: the first) checkpoints first:
    never with checkpoints off (`every` 0); else every `every`-th publication, or, `every_s` >
    0, the first one at least `every_s` seconds of the run's clock (`now_s`) after the last
    checkpoint (`last_s`; None: none yet, so the first publication does). The version count
    bounds the disk written for a big model (hub.learning.fitting raises it); the clock bounds
    what a kill loses: a run of 40 s steps publishing every step, checkpointing every 7th,
    would lose up to 4.7 minutes, at `every_s` 180 at most 3."""
    if every == 0:
        return False
    if last_s is None or published % every == 0:
        return True
    return every_s > 0 and now_s - last_s >= every_s
