"""Why an attempt to reach the hub failed, in our words, and whether another one can ever work.

The client's reconnect loop hands each failed attempt to `Attempts.failed`, which answers with
the text of the retry line, or with a `HubNotFound` to give up with (one sentence: the cause and
the fix). Given up on, before any welcome: an answer that is not a websocket (a wrong path, the
dashboard's port, another server: probed once to say which), a host name that does not resolve
DNS_ATTEMPTS times in a row, a certificate we do not trust, no TLS for a wss:// URL. All else
may come back and is retried: no hub listening yet, a timeout, a hub restarting, a proxy's 5xx.
So is everything once a hub has welcomed us at this URL (a name resolved, a path answered).
aiohttp's own texts are not shown: they say `ssl:default` even for ws://. Owns no timer.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import aiohttp

from echo2p2p.errors import HubNotFound, ProtocolError

DNS_ATTEMPTS = 3  # look-ups in a row: one failure may be a resolver's hiccup, three are a typo
PROBE_TIMEOUT_S = 5.0  # for each GET that tells what answered instead of a hub
PROBE_BYTES = 64 << 10  # read no more of what answers a probe
RETRIED_STATUSES = frozenset({408, 429})  # and every 5xx: a proxy whose hub is away
WHERE = ("join the URL `echo2-hub serve` prints as 'listening on ws://HOST:PORT/ws' (port 8765 "
         "unless the hub's --port set another)")


class Attempts:
    """The failed attempts on one hub URL (ws://HOST:PORT/PATH, normalized)."""

    def __init__(self, url: str, connect_timeout_s: float):
        parts = urlsplit(url)
        self.url = url
        self.address = parts.netloc  # HOST:PORT, as the user wrote it
        self.path = parts.path
        self.connect_timeout_s = connect_timeout_s
        self._unresolved = 0  # failed look-ups in a row

    async def failed(self, http: aiohttp.ClientSession, exc: BaseException,
                     welcomed: bool) -> str | HubNotFound:
        """What to say of attempt-ending `exc`: the retry line's text, or the error to give up
        with. `welcomed`: a hub welcomed us at this URL before (then we always retry)."""
        dns = isinstance(exc, aiohttp.ClientConnectorDNSError)
        self._unresolved = self._unresolved + 1 if dns else 0
        if not welcomed:
            if dns and self._unresolved >= DNS_ATTEMPTS:
                return HubNotFound(
                    f"host {exc.host} not found ({exc.strerror}; {self._unresolved} attempts): "
                    f"check the host name in {self.url}")
            if isinstance(exc, aiohttp.ClientConnectorCertificateError):
                return HubNotFound(
                    f"hub {self.address}'s TLS certificate is not trusted ({_cert_reason(exc)}): "
                    f"pass the PEM of the authority that signed it with --ca-cert")
            if isinstance(exc, aiohttp.ClientSSLError):
                return HubNotFound(
                    f"no TLS at {self.address} ({getattr(exc.os_error, 'reason', exc.strerror)}):"
                    f" a hub serves wss:// only with --tls-cert; join ws://{self.address}"
                    f"{self.path} if it has none")
            if isinstance(exc, aiohttp.WSServerHandshakeError) and not _retried(exc.status):
                return await self._not_a_hub(http, exc.status)
        return self.describe(exc)

    def describe(self, exc: BaseException) -> str:
        """Why the attempt failed, for the retry line."""
        if isinstance(exc, aiohttp.ClientConnectorDNSError):
            return f"host {exc.host} not found ({exc.strerror})"
        if isinstance(exc, aiohttp.ClientConnectorError):
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            why = "connection refused: nothing listens on that port" if refused else exc.strerror
            return f"hub {self.address} not reachable ({why})"
        if isinstance(exc, aiohttp.WSServerHandshakeError) and exc.status == 429:
            return (f"hub {self.address} turns joins away for now (HTTP 429: too many from this "
                    f"address or network, or in all)")
        if isinstance(exc, aiohttp.WSServerHandshakeError):
            return f"hub {self.address} not ready (it answered HTTP {exc.status} on {self.path})"
        if isinstance(exc, TimeoutError):
            return f"hub {self.address} not reachable (no answer in {self.connect_timeout_s:g} s)"
        if isinstance(exc, ProtocolError):
            return f"hub {self.address} broke off ({exc.reason})"
        return f"connection to hub {self.address} lost ({exc or type(exc).__name__})"

    async def _not_a_hub(self, http: aiohttp.ClientSession, status: int) -> HubNotFound:
        """What answered HTTP `status` instead of a websocket, in one sentence with the fix:
        a hub on another path (GET /ws answers), a hub's dashboard (GET /status answers as a
        hub's does: the dashboard has no /ws), or something else."""
        scheme, base = ("wss", "https") if self.url.startswith("wss:") else ("ws", "http")
        base = f"{base}://{self.address}"
        told = f"{self.address} answered HTTP {status} on {self.path}"
        if self.path != "/ws" and (await _get(http, f"{base}/ws"))[0] not in (None, 404):
            return HubNotFound(f"{told}, not a hub's peer endpoint: a hub answers on /ws there, "
                               f"join {scheme}://{self.address}/ws")
        if _is_hub_status(*await _get(http, f"{base}/status")):
            return HubNotFound(f"{self.address} is a hub's dashboard, not its peers' port (HTTP "
                               f"{status} on {self.path}): {WHERE}")
        return HubNotFound(f"{told}: no hub's peer endpoint is there; {WHERE}")


def _retried(status: int) -> bool:
    """An answer that may change: too many requests, a timeout, a proxy whose hub is away."""
    return status in RETRIED_STATUSES or 500 <= status < 600


def _cert_reason(exc: aiohttp.ClientConnectorCertificateError) -> str:
    error = exc.certificate_error
    return getattr(error, "verify_message", None) or str(error)


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int | None, bytes]:
    """GET `url`: its status and (the start of) its body; (None, b"") if nothing answered."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with http.get(url, allow_redirects=False) as resp:
                return resp.status, await resp.content.read(PROBE_BYTES)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None, b""


def _is_hub_status(status: int | None, body: bytes) -> bool:
    """Does this answer GET /status as a hub does (its JSON, or the dashboard's 401)? Only our
    hub's answer counts; nothing of what a stranger answered is shown."""
    if status == 401:
        return b"dashboard token" in body
    try:
        answer = json.loads(body) if status == 200 else None
    except ValueError:
        return False
    return isinstance(answer, dict) and {"run_id", "hub_key"} <= answer.keys()
