"""The hub's check of a relay looks like any receiver (issue 42, item 6).

A relay that can tell the hub's check from a receiver's request serves the check at once and
everyone else as slowly as their deadline allows, so the hub, which believes no report without
its own measurement, keeps dealing it chunks. This attacker looks at everything one request
and its connection show: the ticket's peer id (`hub`), its key (the hub's own, from the
welcome), the request's headers and query against those of the receivers it knows (ids its
own relay plans named), the connection and the peer id of any request it already took for the
hub's, and the version asked (a chunk of a version older than the newest it was announced: a
check that came after a report). On the tracker (`relay="pipelined"`), where plans name relays.

What it does not use, since no identity the hub makes up can pass it: whether the requester was
ever named as a source in one of its plans (a check is a receiver that never relayed, as a leaf
is), and the source address (the hub's; on loopback every address is the same).

The relay runs in a process of its own (tests/hostile/peer_attacks.py, kind "discerning"), its
chunks fetched from the hub's chunk route under its own ticket, so that its work does not land
on the hub's event loop, whose learner steps a minute the table shows.
"""

from __future__ import annotations

from echo2p2p.hub.serving.counters import PeerView

from tests.conftest import peer_until, until
from .conftest import yes
from .harness import (HONEST, Rates, attacker_process, family, hub_alive, hub_and_honest_peer,
                      mark, peer_id, run_events, small_cfg, steps_per_min, still_training)

CHECKS_ON_MAIN = 2  # checks that cleared it: the hub did not see the attack
NAME = "discerning-relay"


def named_next(report: dict, version: int) -> bool | None:
    """Whether the plan of the first version announced to the relay after `version` named it a
    source (None: none announced yet), from its report's `announced: <v>` counts."""
    later = {int(v): named for v, named in family(report, "announced").items() if int(v) > version}
    return bool(later[min(later)]) if later else None


async def test_a_relay_cannot_tell_the_hubs_check_from_a_receiver(tmp_path, row):
    """A relay that serves whatever looks like the hub at once and every receiver slowly is
    timed by the hub under an identity of a receiver's, found slow, and dealt no more chunks;
    the honest peer keeps training."""
    r = row("42-6. the hub's check: a relay slow to receivers, quick to whatever looks like "
            "the hub (peer id, key, headers, query, connection, an older version)")
    cfg = small_cfg(tmp_path, relay="pipelined", anchor_every=1)  # one broadcast per version
    dealt_after = None
    async with hub_and_honest_peer(cfg) as (run, honest):
        honest_id = peer_id(run, HONEST)
        without = await steps_per_min(run)
        async with attacker_process("discerning", run.url, name=NAME,
                                    stall_s=honest.cfg.relay_stall_s) as relay:
            await relay.wait_report(lambda c: c.get("welcomed") == 1)
            relay_id = peer_id(run, NAME)

            def conn() -> PeerView:  # the hub's view of the attacker now
                return run.hub.peer_views()[relay_id]

            def checks() -> list[tuple[str, str]]:
                return [(e["reason"], e["verdict"]) for e in run_events(run, "relay_check")
                        if e["accused"] == relay_id]

            await until(run.hub, lambda: conn().relay != "unprobed", 60)
            assert conn().relay == "ok", f"the relay was not admitted as one: {conn().relay}"
            since = mark(run, honest)
            # The attack is under way.
            await relay.wait_report(lambda c: c.get(f"slow: {honest_id}"), 120)
            with_ = await steps_per_min(run)
            await until(run.hub, lambda: conn().relay != "ok"
                        or len(checks()) >= CHECKS_ON_MAIN, 180)
            last = conn()  # as the hub saw it when the verdict was in (or the checks cleared it)
            r.reaction = (f"hub's checks (reason, verdict) {checks()}; status {last.relay}; "
                          f"requests it took for the hub's {family(relay.report, 'fast')}; "
                          f"slow chunks served {family(relay.report, 'slow')}")
            if last.relay != "ok":
                judged = run.hub.core.tracker.snapshot().manifest.version  # the newest version at the verdict
                loaded = honest.statistics().versions_loaded
                r.honest_training = await still_training(run, honest, since)
                # Once a version wholly fetched after the verdict is in, the rate without its
                # share.
                await peer_until(honest, lambda: honest.statistics().versions_loaded
                                 >= loaded + 2, 120)
                r.note = f"after the verdict: {await steps_per_min(run):.1f} steps/min"
                report = await relay.wait_report(lambda c: named_next(c, judged) is not None)
                dealt_after = named_next(report, judged)
                r.reaction += f"; in the next version's plan: {'YES' if dealt_after else 'no'}"
        report = relay.report  # its last counts, as it stopped
        after = await steps_per_min(run)
        r.hub_alive = yes(alive := await hub_alive(run))
    r.steps_per_min = Rates(without, with_, after).cell()
    fast = family(report, "fast")
    assert alive
    assert last.relay == "slow" and ("slow", "slow") in checks(), r.reaction
    assert not dealt_after, "the slow relay still owns chunks of a version after the verdict"
    # The hub's reachability probe at its join (a chunk with no wait, under the hub's ticket)
    # may give itself away, and nothing else: no check.
    assert all(tell.endswith("(wait=0)") for tell in fast), fast
