"""The live dashboard: a port of its own with the page, its files, and the run as JSON and events.

Routes: `/` (hub/view/page/index.html), `/static/{name}` (an allow-list of that folder's files),
`/status` (`echo2p2p.hub.view.status`), `/metrics` (`echo2p2p.hub.view.metrics`), `/api/snapshot` (the
feed's downsampled history with the status) and `/events` (server-sent events from the
`echo2p2p.hub.view.feed.Feed`: hello, step, eval, version, and status every STATUS_EVERY_S while
clients listen). With `dashboard_token` set every request needs it, as `Authorization: Bearer`
or `?token=` (and /status on the peers' port answers only its public part without it,
`status_route`); TLS is the hub's (tls_cert/tls_key). Behind the HTTP idle and request-head
deadlines (`echo2p2p.runtime.http_deadlines`), which never cut a response being sent: an event
stream stays open, with a comment line every HEARTBEAT_S so that proxies keep it too. Every
request spends from its address's budget (`hub.serving.http_limits`: an event stream is a page
request and one of the streams an address may hold open), checked before the token; the
status, the snapshot, the page and /metrics are built at most once a moment (`Recent`), and
the page's files are read once and served from memory.
Reads the run, never changes it; knows nothing of how records are made.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import socket
from html import escape as html_escape
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from echo2p2p.rates import rate_text
from echo2p2p.request_budget import STREAMS, RequestBudget
from echo2p2p.runtime import http_deadlines

from ..serving.app import bind, tls_context
from ..serving.http_limits import Recent, budget_middleware, request_budget
from .feed import Feed, event_frame, finite_json
from .metrics import metrics_handler
from ..config_sections import is_loopback
from .status import public_status, status

if TYPE_CHECKING:
    from .status import HubRun

log = logging.getLogger(__name__)

FILES = Path(__file__).with_name("page")
STATIC = ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css")
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css"}
STATUS_EVERY_S = 2.0
HEARTBEAT_S = 15.0
REPLAYED = ("eval", "step", "propagation")  # the run log records a resumed feed starts from
INLINE_SCRIPT = re.compile(rb"<script>(.*?)</script>", re.S)
CSP = ("default-src 'self'; script-src 'self' {scripts}; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store"}  # the token may be in the URL: never sent on, never cached

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def dashboard(run: HubRun, sock: socket.socket | None = None,
                    budget: RequestBudget | None = None) -> AsyncIterator[int | None]:
    """`start_hub`'s dashboard: none (None) when cfg.view.dashboard_port is -1, else a feed on the
    run log, served on cfg.view.dashboard_host:dashboard_port (or on `sock`, bound already)
    under `budget` (`serve_dashboard`); yields the bound port."""
    cfg = run.cfg
    if cfg.view.dashboard_port < 0:
        yield None
        return
    feed = Feed()
    if run.resumed:  # the history before the restart, from the run log
        for record in await asyncio.to_thread(logged_before, run.runlog.run_dir, run.hub.core.step):
            feed.record(record)
    run.runlog.listeners.append(feed.record)
    try:
        async with serve_dashboard(run, feed, sock=sock, budget=budget) as port:
            host = f"[{cfg.view.dashboard_host}]" if ":" in cfg.view.dashboard_host else cfg.view.dashboard_host
            log.info("dashboard on %s://%s:%d/", "https" if cfg.network.tls_cert else "http", host, port)
            yield port
    finally:
        run.runlog.listeners.remove(feed.record)


@contextlib.asynccontextmanager
async def serve_dashboard(run: HubRun, feed: Feed, port: int | None = None, *,
                          sock: socket.socket | None = None, budget: RequestBudget | None = None
                          ) -> AsyncIterator[int]:
    """Serve `run`'s dashboard from `feed` on cfg.view.dashboard_host, port `port` (None: cfg's;
    0: a free one), or on `sock` (bound already: `hub.serving.app.bind`), under `budget` (None:
    one of its own, as cfg.limits says); yields the bound port. Open event streams end on exit."""
    cfg = run.cfg
    budget = budget or request_budget(cfg.limits)
    recent = Recent()

    def now() -> dict[str, Any]:  # the status of the moment, shared by the routes below
        return recent.get("status", lambda: status(run))

    app = web.Application(middlewares=[budget_middleware(budget, {"/events": STREAMS}),
                                       token_check(cfg.view.dashboard_token)])
    app.on_response_prepare.append(_secure_headers)
    app.router.add_get("/", _index(now, recent))
    app.router.add_get("/static/{name}", _static())
    app.router.add_get("/status", json_answer(now, recent, "status"))
    app.router.add_get("/metrics", metrics_handler(run, budget=budget))
    app.router.add_get("/api/snapshot", json_answer(lambda: snapshot(run, feed, now()), recent,
                                                    "snapshot"))
    app.router.add_get("/events", _events(run, feed))
    app.cleanup_ctx.append(_status_ticker(now, feed))
    tls = tls_context(cfg.network.tls_cert, cfg.network.tls_key)
    runner = http_deadlines.runner(app)  # idle and request-head deadlines
    await runner.setup()
    try:
        port = cfg.view.dashboard_port if port is None else port
        sock = sock or bind(cfg.view.dashboard_host, port, "dashboard_port")
        await web.SockSite(runner, sock, ssl_context=tls).start()
        yield runner.addresses[0][1]
    finally:
        feed.close()  # the event streams end, so the runner's shutdown need not wait for them
        await runner.cleanup()


def snapshot(run: HubRun, feed: Feed, now: dict[str, Any] | None = None) -> dict[str, Any]:
    """What /api/snapshot answers: everything the page draws (`now`: the status, if built)."""
    now = status(run) if now is None else now
    return {"run_id": run.hub.core.run_id, "max_lag": run.cfg.staleness.max_lag, "kappa": run.cfg.staleness.kappa,
            "step": run.hub.core.step, **feed.snapshot(), "staleness": now["staleness"],
            "status": now}


def logged_before(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """What a run resumed at `step` logged before it: the step records of steps 0 .. step - 1,
    the evaluation and propagation records of versions up to `step` (those after the
    checkpoint are trained, and logged, again), the last of each, in order. Lines that do not
    parse are passed over."""
    kept: dict[tuple[int, int], dict[str, Any]] = {}
    with (run_dir / "metrics.jsonl").open(encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
                kind = record.get("event", "step")
                at = record["step"] + 1 if kind == "step" else record["version"]  # its version
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if kind in REPLAYED and isinstance(at, int) and at <= step:
                kept[(at, REPLAYED.index(kind))] = record  # a version's eval before its step
    return [kept[key] for key in sorted(kept)]


def token_check(token: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """A middleware refusing (401) any request without `token` ('' = none needed)."""
    expected = token.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token and not _carries(request, expected):
            return web.Response(status=401, text="dashboard token missing or wrong: send "
                                "Authorization: Bearer TOKEN or ?token=TOKEN\n")
        return await handler(request)

    return check


def status_route(run: HubRun) -> Handler:
    """GET /status on the peers' port, which anyone who can reach the hub may ask: all of it
    with the dashboard token (with none set: on a hub listening on loopback only), else only
    the run's public part (`status.public_status`), which is what health checks need. Each
    is built at most once a moment."""
    token, recent = run.cfg.view.dashboard_token, Recent()
    everything = json_answer(lambda: status(run), recent, "status")
    public = json_answer(lambda: public_status(run), recent, "public")

    async def handle(request: web.Request) -> web.Response:
        full = _carries(request, token.encode()) if token else is_loopback(run.cfg.network.host)
        return await (everything if full else public)(request)

    return handle


def _carries(request: web.Request, expected: bytes) -> bool:
    """Whether the request's bearer header or its ?token= is `expected` (in constant time)."""
    header = request.headers.get("Authorization", "")
    given = [header[len("Bearer "):]] if header.startswith("Bearer ") else []
    given += request.query.getall("token", [])[:1]
    return any(hmac.compare_digest(g.encode(), expected) for g in given)


async def _secure_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(HEADERS)


def _index(now: Callable[[], dict[str, Any]], recent: Recent) -> Handler:
    """The page, with the run's figures of the moment (`now()`, a /status answer) in its tiles
    (a first paint for scripts and slow clients: dashboard.js redraws them), and a CSP that
    allows its own inline scripts by their hashes and nothing else inline: a peer's name that
    ever reached the DOM as markup could not run. The file is read once; the page built at most
    once a moment."""
    page: list[bytes] = []

    def painted() -> tuple[bytes, str]:
        html = first_paint(page[0], now())
        scripts = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s).digest()).decode()}'"
                           for s in INLINE_SCRIPT.findall(html))
        return html, CSP.format(scripts=scripts)

    async def handle(request: web.Request) -> web.Response:
        if not page:
            page.append(await asyncio.to_thread((FILES / "index.html").read_bytes))
        html, csp = recent.get("page", painted)
        return web.Response(body=html, content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": csp})

    return handle


def first_paint(html: bytes, now: dict[str, Any]) -> bytes:
    """`html` with the tiles' placeholders replaced by `now`'s (a /status answer) figures,
    formatted as dashboard.js formats them. Only the hub's own numbers and run id: no peer's
    text is written into the page here."""
    last, cost = now.get("last") or {}, now.get("cost") or {}
    busy = last.get("hub/learner_busy_frac")
    states = [p.get("state") for p in (now.get("peers") or {}).values()]
    values = {"run-id": now.get("run_id"), "max-lag": now.get("max_lag"),
              "kappa": now.get("kappa"), "tile-step": _shown(last.get("step"), ".0f"),
              "tile-version": _shown(now.get("published_version"), ".0f"),
              "tile-reward": _shown(last.get("train/reward_mean"), ".3f"),
              "tile-busy": None if _shown(busy, ".0%") is None else f"{100 * busy:.0f} %",
              "tile-rate": _shown(last.get("rollout/per_s"), "rate"),
              "tile-usd-total": _shown(cost.get("cost/usd_total"), ".4f", "$"),
              "tile-usd-hour": _shown(cost.get("cost/usd_per_hour"), ".3f", "$"),
              "tile-usd-1k": _shown(cost.get("cost/usd_per_1k_rollouts"), ".4f", "$"),
              "tile-lp-bound": _shown(cost.get("lp_bound_usd_per_hour"), ".3f", "$"),
              "tile-peers": " · ".join(str(states.count(s))
                                       for s in ("active", "standby", "quarantined")),
              "tile-evaluating": _evaluating(now.get("evaluating"))}
    for key, value in values.items():
        if value is not None:
            text = html_escape(str(value)).encode()
            blank = "" if key == "tile-evaluating" else "–"  # a line that is empty, not a figure
            html = html.replace(f'id="{key}">{blank}<'.encode(), f'id="{key}">'.encode() + text + b"<")
    return html


def _evaluating(progress: Any) -> str | None:
    """`evaluating v0: 128/200` from the status's "evaluating" (as dashboard.js writes it);
    None when none runs."""
    if not isinstance(progress, dict):
        return None
    figures = [_shown(progress.get(k), ".0f") for k in ("version", "done", "total")]
    if None in figures:
        return None
    return f"evaluating v{figures[0]}: {figures[1]}/{figures[2]}"


# `value`: a JSON value from the status.
def _shown(value: Any, spec: str, prefix: str = "") -> str | None:
    """`value` formatted by `spec` (or "rate": `rate_text`) when it is a finite number, else
    None (the "–" stays)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return prefix + (rate_text(value) if spec == "rate" else format(value, spec))


def _static() -> Handler:
    """GET /static/{name}: the allow-listed files of the page, each read once (small: about
    80 KB in all) and served from memory."""
    kept: dict[str, bytes] = {}

    async def handle(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound(text="no such file\n")
        if name not in kept:
            kept[name] = await asyncio.to_thread((FILES / name).read_bytes)
        return web.Response(body=kept[name], content_type=STATIC_TYPES[Path(name).suffix])

    return handle


def json_answer(data: Callable[[], Any], recent: Recent | None = None, key: str = "") -> Handler:
    """A GET handler answering `data()` as JSON (not finite numbers as null); with `recent`,
    the text kept there under `key` for a moment, so a flood costs one build a moment."""

    def text() -> str:
        return finite_json(data())

    async def handle(request: web.Request) -> web.Response:
        body = text() if recent is None else recent.get(("json", key), text)
        return web.Response(text=body, content_type="application/json")

    return handle


def _events(run: HubRun, feed: Feed) -> Handler:
    """GET /events: hello, then the feed's events as they come, until the client goes or
    falls behind (then its connection is cut)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "X-Accel-Buffering": "no"})  # nginx: stream it
        await response.prepare(request)
        transport = request.transport
        subscriber = feed.subscribe(on_drop=transport.abort if transport else lambda: None)
        try:
            await response.write(b"retry: 2000\n\n" + event_frame(
                "hello", {"run_id": run.hub.core.run_id, "step": run.hub.core.step}))
            while not subscriber.closed:
                frames = await subscriber.wait_frames(HEARTBEAT_S)
                if frames or not subscriber.closed:
                    await response.write(frames or b": keep-alive\n\n")
        except ConnectionResetError:
            pass  # the client went, or was cut for falling behind
        finally:
            feed.unsubscribe(subscriber)
        return response

    return handle


def _status_ticker(now: Callable[[], dict[str, Any]], feed: Feed
                   ) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context: the status event (`now()`), every STATUS_EVERY_S while any client
    listens."""

    async def tick() -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY_S)  # a timer, not a sync
            if feed.clients:
                feed.publish("status", now())

    async def ticking(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(tick())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ticking

