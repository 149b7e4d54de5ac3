"""An impostor hub (issue 11, item 8): a server that answers a peer's hello with the real hub's
public key, which is public, and relays the real hub's signed versions, but cannot sign the
peer's fresh nonce. A peer that pins the real key (--hub-key) must refuse it: never generate
for it, never send it a rollout or ask it for work, and say why.
"""

from __future__ import annotations

import asyncio
import logging

from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig

from tests.conftest import wait_first
from .attackers import impostor_hub
from .conftest import yes
from .harness import hub_alive, hub_and_honest_peer, mark, small_cfg, still_training


async def test_pinned_peer_refuses_an_impostor_that_echoes_the_hub_key(tmp_path, row, caplog):
    """A peer pinned to the hub key refuses an impostor echoing it: asks no work, does none."""
    r = row("8. impostor hub echoing the real hub key (peer pinned with --hub-key)")
    caplog.set_level(logging.WARNING, logger="echo2p2p.peer.client")
    async with hub_and_honest_peer(small_cfg(tmp_path)) as (run, honest), \
            impostor_hub(run) as impostor:
        since = mark(run, honest)
        victim = PeerClient(PeerConfig(hub_url=impostor.url, name="victim", listen="",
                                       hub_key=run.hub.core.hub_key.hex(), torch_threads=1,
                                       reconnect_max_s=1.0))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            joining = tg.create_task(victim.run(stop))
            try:
                # Refused (it came back after hanging up, or gave up), or taken in.
                await wait_first(joining, impostor.heard.until(
                    lambda: impostor.hellos >= 2 or "lease_request" in impostor.received, 120),
                    timeout_s=120)
            finally:
                stop.set()
        why = [rec.getMessage().replace(impostor.url, "IMPOSTOR") for rec in caplog.records
               if rec.name == "echo2p2p.peer.client" and impostor.url in rec.getMessage()]
        s = victim.statistics()
        r.reaction = (f"victim: {impostor.hellos} hellos, {impostor.hung_up} hang-ups, "
                      f"sent it {sorted(set(impostor.received)) or 'nothing else'}, "
                      f"{s.submitted} rollouts; logged: {why[0][:140] if why else '-'}")
        r.honest_training = await still_training(run, honest, since)
        r.hub_alive = yes(alive := await hub_alive(run))
    assert alive
    assert "lease_request" not in impostor.received and "rollout" not in impostor.received, \
        impostor.received
    assert s.connections == 0 and s.submitted == 0, s
    assert why, "the victim never said why it left"
