"""The peer's fetcher: one download per announced version, and staging what completes.

A `VersionAnnounced` event starts a download (`echo2p2p.overlay.download.Download`: chunks over
HTTP by the hub's relay plan, failing over from bad sources), superseding an older one still
under way; a `PlanRevised` event re-routes it. A complete version is reported to the hub
(`TransferReport`) and handed, as tensors, to the worker's swapper — or, for a relay node that
generates nothing, held and announced as held. The fetcher never touches the engine, and what
it decides about which announcement wins is the connection protocol's
(`echo2p2p.peer_protocol`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from echo2p2p import messages as m
from echo2p2p.errors import SnapshotError
from echo2p2p.overlay.download import Download

if TYPE_CHECKING:
    from echo2p2p.overlay.store import Held

    from .client import PeerClient
    from .connection import HubConnection

log = logging.getLogger(__name__)


class Fetcher:
    """The download of the connection now (at most one), and the bytes fetched so far."""

    def __init__(self, peer: PeerClient):
        self.peer = peer
        self.bytes_from_hub = self.bytes_from_peers = 0  # chunk bytes of every version fetched
        self.versions_fetched = 0  # downloads that completed and verified
        self._download: tuple[Download, asyncio.Task] | None = None

    @property
    def downloaded_bytes(self) -> int:
        """Chunk bytes of every version fetched, from the hub and from peers."""
        return self.bytes_from_hub + self.bytes_from_peers

    @property
    def download(self) -> Download | None:
        """The download under way, if any."""
        return self._download[0] if self._download is not None else None

    def start(self, conn: HubConnection, manifest: m.Manifest, plan: m.RelayPlan) -> None:
        """Fetch the announced version, dropping the older download still under way."""
        self.cancel()
        peer = self.peer
        held = peer.store.begin(manifest)
        if held is None:
            log.warning("v%d is a delta against v%s, which we no longer hold; waiting for a full "
                        "version", manifest.version, manifest.base_version)
            return
        cfg = peer.cfg
        download = Download(peer.store, held, http=conn.http, hub_base_url=conn.hub_base_url,
                            me=peer.welcome.peer_id, report=conn.send, stall_s=cfg.relay_stall_s,
                            credentials=peer.credentials, first=self.downloaded_bytes == 0)
        download.set_plan(plan)
        conn.protocol.download_started(manifest)
        self._download = (download, conn.tg.create_task(self._fetch_version(conn, download)))

    def revise(self, plan: m.RelayPlan) -> None:
        """A newer relay plan for the download under way (the protocol matched it)."""
        if self._download is not None:
            self._download[0].set_plan(plan)

    def cancel(self) -> None:
        """Stop the download under way (a newer version, or the connection is gone)."""
        if self._download is not None:
            self._download[1].cancel()
            self._download = None

    async def _fetch_version(self, conn: HubConnection, download: Download) -> None:
        held = download.held
        version = held.manifest.version
        try:
            stats = await download.run()
            self.bytes_from_hub += stats.bytes_from_hub
            self.bytes_from_peers += stats.bytes_from_peers
            await asyncio.to_thread(self.peer.store.finish, held)
            self.versions_fetched += 1
        except SnapshotError as exc:
            log.error("giving up on v%d: %s", version, exc)
            return
        finally:
            conn.protocol.download_ended(held.manifest)
            if self._download is not None and self._download[0] is download:
                self._download = None
        log.info("v%d complete in %.2f s (%d bytes from the hub, %d from peers)", version,
                 stats.download_s, stats.bytes_from_hub, stats.bytes_from_peers)
        await conn.send(m.TransferReport(
            version, held.manifest.base_version, stats.download_s, stats.bytes_from_hub,
            stats.bytes_from_peers, stats.sources))
        await self._stage(conn, version, held)

    async def _stage(self, conn: HubConnection, version: int, held: Held) -> None:
        worker = self.peer.worker
        if worker.version == version:
            return  # announced again after a reconnect: the engine has it already
        if self.peer.cfg.engine == "relay":
            worker.set_version(version)
            await conn.send(m.VersionHeld(version))
            return
        from echo2p2p.policy.weights import tensors_to_state

        state = await asyncio.to_thread(lambda: tensors_to_state(held.assembler.tensors()))
        worker.stage(version, state)
