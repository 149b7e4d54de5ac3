"""The peer's fetcher: one download per announced version, and staging what completes.

A `VersionAnnounced` event starts a download (`echo2p2p.overlay.download.Download`: chunks over
HTTP by the hub's relay plan, failing over from bad sources; or, when the plan is a gossip one,
`echo2p2p.overlay.gossip_download.GossipDownload` over the peer's `Links`), superseding an older
one still under way; a `PlanRevised` event re-routes it. A tracker download belongs to its hub
connection and ends with it; a gossip download outlives it (its task is the links'), and the
announcement of the same version on the next connection finds it still running.
A complete version is reported to the hub
(`TransferReport`) and handed to the swapper (`swapper.Swapper`): as tensors, or, for a relay
node that generates nothing, as held in the store. The fetcher owns the chunk store (a new run
starts a new one), never touches the engine, and what it decides about which announcement wins
is the connection protocol's (`echo2p2p.peer_protocol`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from echo2p2p import messages as m
from echo2p2p.errors import SnapshotError
from echo2p2p.overlay.download import Download
from echo2p2p.overlay.gossip_download import GossipDownload
from echo2p2p.overlay.links import Links
from echo2p2p.overlay.store import ChunkStore

if TYPE_CHECKING:
    from echo2p2p.overlay.serving import UploadMeter
    from echo2p2p.overlay.store import Held
    from echo2p2p.overlay.tickets import Credentials, Tickets
    from echo2p2p.peer_protocol import PeerProtocol

    from .config import PeerConfig
    from .connection import HubConnection
    from .swapper import Swapper

log = logging.getLogger(__name__)


class Fetcher:
    """The chunk store, the download of the connection now (at most one), and the bytes fetched
    so far. `send` drops what it cannot send; `chunk_store(keep_versions)` makes a store (a liar
    may make one that serves corrupt chunks)."""

    def __init__(self, cfg: PeerConfig, swapper: Swapper,
                 send: Callable[[m.Message], Awaitable[None]], meter: UploadMeter,
                 *, tickets: Tickets, chunk_store: Callable[[int], ChunkStore] = ChunkStore):
        self.cfg, self._swapper, self._send = cfg, swapper, send
        self._chunk_store = chunk_store
        self.store = chunk_store(cfg.keep_versions)
        self.credentials: Credentials | None = None  # who we are to chunk servers: `adopt`
        self.bytes_from_hub = self.bytes_from_peers = 0  # chunk bytes of every version fetched
        self.versions_fetched = 0  # downloads that completed and verified
        self._download: tuple[Download, asyncio.Task] | None = None
        self.links = Links(self._identity, meter, degree=cfg.gossip_degree,
                           max_links=cfg.gossip_max_links, upload_limit_mbps=cfg.upload_limit_mbps,
                           want_timeout_s=cfg.relay_stall_s, tickets=tickets)
        self._protocol: PeerProtocol | None = None  # the connection that announced the download

    def _identity(self) -> tuple[str | None, Credentials | None]:
        """Who we are to other peers' chunk servers now (a reconnect gives a new peer id)."""
        c = self.credentials
        return (c.peer_id if c else None), c

    def adopt(self, credentials: Credentials) -> None:
        """A welcome's credentials: what we show chunk servers from now on."""
        self.credentials = credentials

    def drop_versions(self) -> None:
        """Forget every version held (another run's, or a resumed hub's): a new store."""
        self.store = self._chunk_store(self.cfg.keep_versions)

    @property
    def downloaded_bytes(self) -> int:
        """Chunk bytes of every version fetched, from the hub and from peers."""
        return self.bytes_from_hub + self.bytes_from_peers

    @property
    def download(self) -> Download | None:
        """The download under way, if any."""
        return self._download[0] if self._download is not None else None

    def start(self, conn: HubConnection, manifest: m.Manifest, plan: m.RelayPlan) -> None:
        """Fetch the announced version, dropping the older download still under way (a gossip
        download of this very manifest carries on, with the neighbours of this plan; one of
        another manifest under the same number, redone by a resumed hub, is dropped)."""
        running = self.download
        if isinstance(running, GossipDownload) and running.held.manifest == manifest:
            conn.protocol.download_started(running.held.manifest)
            self._protocol = conn.protocol
            running.set_plan(plan)
            return
        self._drop()
        held = self.store.begin(manifest)
        if held is None:
            log.warning("v%d is a delta against v%s, which we no longer hold; waiting for a full "
                        "version", manifest.version, manifest.base_version)
            return
        assert self.credentials is not None  # adopted before the connection is read
        kwargs = dict(http=conn.http, hub_base_url=conn.hub_base_url, me=self.credentials.peer_id,
                      stall_s=self.cfg.relay_stall_s, credentials=self.credentials,
                      first=self.downloaded_bytes == 0)
        conn.protocol.download_started(manifest)
        self._protocol = conn.protocol
        if plan.swarm is not None:
            try:
                download = GossipDownload(self.store, held, report=self._send, links=self.links,
                                          gossip=plan.swarm, **kwargs)
            except ValueError as exc:
                log.warning("ignoring a gossip plan for v%d: %s", manifest.version, exc)
                return
            task = self.links.spawn(self._fetch_version(download, self._send))
        else:
            download = Download(self.store, held, report=conn.send, **kwargs)
            download.set_plan(plan)
            task = conn.tg.create_task(self._fetch_version(download, conn.send))
        self._download = (download, task)

    def revise(self, plan: m.RelayPlan) -> None:
        """A newer relay plan for the download under way (the protocol matched it)."""
        if self._download is not None:
            self._download[0].set_plan(plan)

    def cancel(self) -> None:
        """The connection is gone: stop a download that needs it (a gossip one carries on)."""
        if not isinstance(self.download, GossipDownload):
            self._drop()

    def _drop(self) -> None:
        """Stop the download under way (a newer version)."""
        if self._download is not None:
            self._download[1].cancel()
            self._download = None

    async def _fetch_version(self, download: Download,
                             send: Callable[[m.Message], Awaitable[None]]) -> None:
        held = download.held
        version = held.manifest.version
        try:
            stats = await download.run()
            self.bytes_from_hub += stats.bytes_from_hub
            self.bytes_from_peers += stats.bytes_from_peers
            await asyncio.to_thread(self.store.finish, held)
            self.versions_fetched += 1
        except SnapshotError as exc:
            log.error("giving up on v%d: %s", version, exc)
            return
        finally:
            if self._protocol is not None:
                self._protocol.download_ended(held.manifest)
            if self._download is not None and self._download[0] is download:
                self._download = None
        log.debug("v%d complete in %.2f s (%d bytes from the hub, %d from peers)", version,
                  stats.download_s, stats.bytes_from_hub, stats.bytes_from_peers)
        await send(m.TransferReport(
            version, held.manifest.base_version, stats.download_s, stats.bytes_from_hub,
            stats.bytes_from_peers, stats.sources))
        await self._stage(version, held)

    async def _stage(self, version: int, held: Held) -> None:
        if self._swapper.version == version:
            return  # announced again after a reconnect: the engine has it already
        if self.cfg.engine == "relay":
            self._swapper.stage(version, None)  # the store holds it: nothing to load
            return
        from echo2p2p.policy.weights import tensors_to_state

        state = await asyncio.to_thread(lambda: tensors_to_state(held.assembler.tensors()))
        self._swapper.stage(version, state)
