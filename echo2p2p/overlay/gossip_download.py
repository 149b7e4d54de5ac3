"""The gossip download: one manifest's chunks from the peer's links, the hub as one seed.

`GossipDownload` runs the core's `echo2p2p.gossip.Swarm`: it feeds it what the links hear
(`have` / `had`, through `Links` as a `Listener`), asks it which chunk to want of whom, and runs
those wants: a link's over the link (`Link.want`), the hub's over its chunk route (the HTTP
fetch of `Download`, which this class extends for that and for its byte accounting). Every piece
is verified by `ChunkStore.add` before it counts; each verified chunk goes out to every link as
`had`, in one frame per loop turn. A corrupt piece closes its link and is reported to the hub
(if reachable); a link that refuses or goes is avoided for this manifest; the hub's failures
only delay its next want. Nothing here depends on the hub's control connection: once the
manifest is here, the download completes from the links (and the hub's chunk route while it
answers), however many times that connection drops.
"""

from __future__ import annotations

import asyncio
import logging
import time

from echo2p2p import messages as m
from echo2p2p.failover import HUB, HUB_RETRY_S
from echo2p2p.gossip import Swarm
from echo2p2p.relay import MAX_NEIGHBOURS
from echo2p2p.runtime.progress import progress_bar

from .download import Download, TransferStats, log_hub_fault
from .link import HONEST_ENDS, Link
from .links import Links

log = logging.getLogger(__name__)


class GossipDownload(Download):
    """Fetch every chunk of one manifest over the gossip links; `run` returns when all are in.
    Takes `Download`'s arguments, plus the peer's `links` and the hub's `gossip` plan."""

    def __init__(self, *args, links: Links, gossip: m.GossipPlan, **kwargs):
        super().__init__(*args, **kwargs)
        self.links = links
        n = len(self.held.manifest.chunks)
        if len(gossip.seed) % 4:
            raise ValueError("gossip seed is not packed uint32")
        seed = m.unpack_ids(gossip.seed)
        self.swarm = Swarm(n, self.me, [i for i in seed if i < n], window=self.window,
                           hub_fallback_s=self.stall_s)
        self.neighbours = gossip.neighbours[:MAX_NEIGHBOURS]
        self._linked: dict[str, Link] = {}

    def set_plan(self, plan: m.RelayPlan) -> None:
        """A newer plan of this manifest: in gossip, a fresh neighbour sample, or the seeds of
        a seeder that left, dealt to us (`hub.core.tracker.VersionTracker.reseed`)."""
        if plan.swarm is None:
            return
        gossip = plan.swarm
        if len(gossip.seed) % 4 == 0:
            n = len(self.held.manifest.chunks)
            self.swarm.add_seed(i for i in m.unpack_ids(gossip.seed) if i < n)
            self._changed.set()
        self.links.heard_of(gossip.neighbours[:MAX_NEIGHBOURS])

    # --- what the links tell us (Listener) ---------------------------------------------

    def link_up(self, link: Link) -> None:
        if not self.swarm.link_up(link.peer_id, reachable=not link.natted):
            return
        self._linked[link.peer_id] = link
        bits = link.bits_of(self.held)  # heard before this download began
        if bits is not None:
            held = [k * 8 + b for k, byte in enumerate(bits) for b in range(8) if byte >> b & 1]
            try:
                self.swarm.heard_had(link.peer_id, held)
            except ValueError as exc:
                self.links.spawn(link.close(str(exc)))
        self._changed.set()

    def link_down(self, link: Link) -> None:
        if self._linked.get(link.peer_id) is link:
            del self._linked[link.peer_id]
            self.swarm.link_down(link.peer_id)
            self._changed.set()

    def heard(self, link: Link, bits: bytes | None, indices: list[int]) -> None:
        """A `have` (bits) or `had` (indices) of this manifest; ValueError if it does not fit."""
        if self._linked.get(link.peer_id) is not link:
            return  # avoided, or refused by the swarm
        if bits is not None:
            self.swarm.heard_have(link.peer_id, bits)
        else:
            self.swarm.heard_had(link.peer_id, indices)
        self._changed.set()

    # --- the loop ----------------------------------------------------------------------

    async def run(self) -> TransferStats:
        manifest, key = self.held.manifest, self.held.key
        start = time.monotonic()
        for i in set(range(len(manifest.chunks))) - set(self.held.assembler.missing):
            self.swarm.got(i)  # resumed: verified before
        self.links.http = self.http
        self.links.changed()
        self.links.begin(self.held, self)
        self.links.heard_of(self.neighbours)
        in_flight: dict[asyncio.Task, tuple[int, str]] = {}
        bar = progress_bar(sum(c.wire_bytes for c in manifest.chunks), f"v{manifest.version}",
                           show=self.first or None)
        try:
            while not self.swarm.complete:
                now = time.monotonic()
                for index, source in self.swarm.requests(now):
                    in_flight[asyncio.create_task(self._want(index, source))] = (index, source)
                wake = self.swarm.wake_at(now)
                timeout = HUB_RETRY_S if wake is None else min(HUB_RETRY_S, max(wake - now, 0.01))
                got = []
                for task in await self._finished(in_flight, timeout):
                    if (entry := in_flight.pop(task, None)) is None:
                        continue
                    index, source = entry
                    if (fault := task.result()) is None and index in self.held.assembler.missing:
                        continue  # a copy verified while another was being written: that one counts
                    if fault is None:
                        got.append(index)
                        bar.update(manifest.chunks[index].wire_bytes)
                        self._cancel_losers(index, self.swarm.got(index, source, time.monotonic()),
                                            in_flight)
                    elif fault != "gone" and (source == HUB or source in self.swarm.wants(index)
                                              or fault != "unreachable"):  # our stall verdict
                        await self._fault(index, source, fault)
                    # else the link went first and took its wants with it (link_down)
                if got:
                    self.links.had(key, got)
        finally:  # superseded (or done): withdraw our wants (each sends its cancel, `Link.want`)
            for task in in_flight:
                task.cancel()
            bar.close()
            self.links.end(self.held, self)
        return self.statistics(time.monotonic() - start)

    def _cancel_losers(self, index: int, losers: list[str],
                       in_flight: dict[asyncio.Task, tuple[int, str]]) -> None:
        """Endgame: `index` is in; withdraw the other wants of it (each sends its cancel)."""
        for task, (i, source) in list(in_flight.items()):
            if i == index and source in losers:
                task.cancel()
                del in_flight[task]

    async def _want(self, index: int, source: str) -> str | None:
        """Chunk `index` from `source`, verified and stored: None, else the fault."""
        if source == HUB:
            return await self._fetch(index, HUB)
        link = self._linked.get(source)
        if link is None:
            return "unreachable"
        asked = time.monotonic()
        data = await link.want(self.held.key, index, self.held.manifest.chunks[index].wire_bytes)
        if data is None:  # refused; or the link closed: honestly (a duplicate, a peer stopping,
            # the other end gone: its wants went with it, `link_down`), or on a fault
            if link.reason is None:
                return "unreachable"
            return "gone" if link.reason in HONEST_ENDS else "stall"
        return await self._keep(index, source, data, asked)

    async def _fault(self, index: int, source: str, fault: str) -> None:
        manifest = self.held.manifest
        report = self.swarm.failed(index, source, time.monotonic())
        if source != HUB:
            self._linked.pop(source, None)  # avoided: the swarm forgot it
        if source == HUB:
            log_hub_fault(self.swarm.hub, index, manifest.version, fault)
            return
        if fault == "corrupt" and (link := self.links.links.get(source)) is not None:
            await link.close("a corrupt piece")
        if report:
            log.warning("link %s %s on v%d; avoiding it", source, fault, manifest.version)
            # `report` (the client's `send`) drops it while the hub is unreachable
            await self.report(m.RelayReport(manifest.version, source, fault, index,
                                            manifest.base_version))
