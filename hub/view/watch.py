"""`echo2-hub status URL`: a terminal summary of a running hub, once or refreshed (`--watch`).

Fetches the hub's /status JSON (from the hub's own port, or from the dashboard's with its
access token) and draws it with rich: a header of the run's figures and a table of its peers.
Everything in that JSON is held to be hostile, since a peer picks its own name and engine: text
is shown as plain text (never read as rich markup), with control characters replaced and cut
short; a number that is not a finite number shows as "-"; at most MAX_ROWS peers are listed.
Knows nothing of the hub but the keys of its /status answer.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from echo2p2p.rates import rate_text

MAX_TEXT = 32  # characters shown of a string the hub or a peer sent
MAX_ROWS = 40  # peers listed; the others are counted in the caption
MAX_BODY_BYTES = 32 << 20  # a /status of 1,000 peers is ~0.5 MB: more is not a hub's answer
STATES = {"active": "green", "standby": "yellow", "quarantined": "red"}
LEGEND = ("adm/s: completions admitted per second over the last 60 s; gen/s: made per second "
          "while busy (the capacity model's input, above adm/s while a peer waits for leases)")


class Unreachable(Exception):
    """The hub did not answer /status with a JSON object; the message says why, in one line."""


def status_url(url: str) -> str:
    """The /status URL of `url`: http(s)://HOST:PORT, with or without /status (a peers' URL,
    ws(s)://HOST:PORT/ws, or a bare HOST:PORT work too). ValueError if it is none of these."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s)://HOST:PORT URL")
    path = parts.path.rstrip("/").removesuffix("/ws")
    return urllib.parse.urlunsplit((scheme, parts.netloc, path.removesuffix("/status") + "/status",
                                    "", ""))


def fetch(url: str, token: str = "", tls: ssl.SSLContext | None = None, timeout_s: float = 5.0
          ) -> dict[str, Any]:
    """The JSON object at `url`, sent `token` as a bearer token; Unreachable if there is none."""
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout_s, context=tls) as answer:
            body = answer.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        reason = exc.read(200).decode("utf-8", "replace").strip().splitlines()
        raise Unreachable(f"{url} answered {exc.code} {one_line(exc.reason)}"
                          + (f": {one_line(reason[0], 120)}" if reason else "")) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        # refused, timed out, bad TLS, no such host, not HTTP
        why = getattr(exc, "reason", exc)
        why = getattr(why, "strerror", None) or why
        raise Unreachable(f"cannot reach {url}: {one_line(why, 120)}") from None
    if len(body) > MAX_BODY_BYTES:
        raise Unreachable(f"{url} answered more than {MAX_BODY_BYTES >> 20} MiB")
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if not isinstance(status, dict):
        raise Unreachable(f"{url} did not answer a JSON object (is it a hub's /status?)")
    return status


# `Any` below is a JSON value from the hub's status, shown as text.
def one_line(value: Any, limit: int = MAX_TEXT) -> str:
    """`value` as at most `limit` printable characters (control characters, escape sequences
    and bidirectional overrides become "?")."""
    text = value if isinstance(value, str) else str(value)
    text = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plain(value: Any, style: str = "") -> Text:
    """Hostile text as a rich Text: shown as it is, never parsed as markup."""
    return Text("-" if value is None else one_line(value), style=style)


def number(value: Any, fmt: str = ".2f") -> str:
    """A finite number formatted (fmt "rate": as every view writes a rate, `rate_text`), else
    "-" (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    if fmt == "rate":
        return rate_text(value)
    if fmt == "d" and not isinstance(value, int):
        return "-"
    text = format(value, fmt)
    return text if len(text) <= 12 else format(value, ".3g")


def ago(seconds: float | None) -> str:
    if number(seconds) == "-" or seconds < 0:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def part(status: dict[str, Any], key: str) -> dict[str, Any]:
    """status[key] if the answer has an object there, else {} (a hostile one may not)."""
    value = status.get(key)
    return value if isinstance(value, dict) else {}


def state_of(peer: dict[str, Any]) -> str:
    """The peer's state as /status gives it, or as its quarantine and activation flags say."""
    if isinstance(peer.get("state"), str):
        return peer["state"]
    if peer.get("quarantined") is True:
        return "quarantined"
    return "active" if peer.get("active", True) is True else "standby"


def eval_of(status: dict[str, Any]) -> tuple[Any, Any] | None:
    """(version, held-out accuracy) of the last record, if it has one."""
    last = part(status, "last")
    accuracy = last.get("eval/accuracy")
    return None if accuracy is None else (last.get("version"), accuracy)


def evaluating(status: dict[str, Any]) -> str:
    """`; evaluating v4: 128/200` while the hub evaluates (the status's "evaluating"), else ""."""
    progress = part(status, "evaluating")
    figures = [number(progress.get(k), "d") for k in ("version", "done", "total")]
    if not progress or "-" in figures:
        return ""
    return f"; evaluating v{figures[0]}: {figures[1]}/{figures[2]}"


def header(status: dict[str, Any], seen_eval: tuple[Any, Any] | None) -> Table:
    """The run's figures, three rows of label and value."""
    last, cost, capacity = part(status, "last"), part(status, "cost"), part(status, "capacity")
    states = [state_of(p) for p in part(status, "peers").values() if isinstance(p, dict)]
    version, accuracy = seen_eval or (None, None)
    lag = f"lag {number(last.get('rollout/staleness_mean'))}"
    dropped = part(part(status, "staleness"), "dropped").values()
    lp_bound = cost.get("lp_bound_usd_per_hour")
    cells = [
        ("run", plain(status.get("run_id"), "bold")),
        ("step", number(status.get("step"), "d")),
        ("version", number(status.get("published_version"), "d")),
        ("reward", number(last.get("train/reward_mean"), ".3f")),
        ("eval", number(accuracy, ".3f") + (f" (v{number(version, 'd')})" if seen_eval else "")
         + evaluating(status)),
        ("S", f"{number(status['max_lag'], 'd')} ({lag})") if "max_lag" in status else ("", lag),
        ("busy", number(last.get("hub/learner_busy_frac"))
         + f" (model {number(capacity.get('capacity/predicted_busy_frac'))})"),
        ("admitted/s", number(last.get("rollout/per_s"), "rate")),
        ("dropped stale", number(sum(n for n in dropped if number(n, "d") != "-"), "d")
         if "staleness" in status else "-"),
        ("$/h", number(cost.get("cost/usd_per_hour"))
         + ("" if lp_bound is None else f" (LP bound {number(lp_bound)})")),
        ("$ total", number(cost.get("cost/usd_total"), ".4f")),
        ("peers", f"{len(states)} ({states.count('active')} active)"),
    ]
    grid = Table.grid(padding=(0, 3))
    for row in (cells[:4], cells[4:8], cells[8:]):
        grid.add_row(*(Text.assemble((label and label + " ", "dim"), value if isinstance(
            value, Text) else Text(value, style="bold")) for label, value in row))
    return grid


def peers_table(status: dict[str, Any], limit: int = MAX_ROWS) -> Table:
    """The peers, active ones first then by name; the first `limit` of them."""
    order = list(STATES)
    rows = sorted((p for p in part(status, "peers").values() if isinstance(p, dict)),
                  key=lambda p: (order.index(s) if (s := state_of(p)) in order else len(order),
                                 one_line(p.get("name"))))
    caption = LEGEND + (f"; and {len(rows) - limit} more peers" if len(rows) > limit else "")
    if status.get("public") is True:  # the hub's port without the dashboard token
        caption = "peers not shown: this hub needs its dashboard token (--token)"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, caption=caption)
    for column in ("name", "engine", "ver", "adm/s", "gen/s", "up Mb/s", "trust", "state", "$",
                   "seen"):  # short: ten columns in 80 characters
        text = column in ("name", "engine", "state")
        table.add_column(column, justify="left" if text else "right", no_wrap=not text,
                         ratio=1 if text else None)
    for p in rows[:limit]:
        state = state_of(p)
        table.add_row(plain(p.get("name")), plain(p.get("engine")),
                      number(p.get("held_version"), "d"), number(p.get("admitted_per_s"), "rate"),
                      number(p.get("gen_rollouts_per_s"), "rate"),
                      number(p.get("upload_mbps")), number(p.get("trust"), ".3f"),
                      plain(state, STATES.get(state, "")), number(p.get("usd"), ".4f"),
                      ago(p.get("last_seen_s")))
    return table


def render(status: dict[str, Any], seen_eval: tuple[Any, Any] | None = None) -> Group:
    """The whole summary of one /status answer; `seen_eval`: the last evaluation seen so far
    (the answer's own last record has one only on an evaluation step)."""
    return Group(header(status, eval_of(status) or seen_eval), peers_table(status))


def watch(fetch_status: Callable[[], dict[str, Any]], interval_s: float, count: int,
          console: Console) -> int:
    """Redraw every `interval_s` seconds, `count` times (0: until interrupted); a hub that does
    not answer is retried, its last answer kept on screen under "reconnecting". 0 if the last
    try was answered, else 1."""
    shown, seen_eval, answered_at, tries = None, None, None, 0
    with Live(console=console, auto_refresh=False) as live:
        while True:
            try:
                status = fetch_status()
            except Unreachable as exc:
                since = "" if answered_at is None else \
                    f" (last answer {time.monotonic() - answered_at:.0f} s ago)"
                note = Text(f"reconnecting: {exc}{since}", style="yellow")
                live.update(note if shown is None else Group(note, shown), refresh=True)
                ok = False
            else:
                seen_eval, answered_at = eval_of(status) or seen_eval, time.monotonic()
                shown = render(status, seen_eval)
                live.update(shown, refresh=True)
                ok = True
            tries += 1
            if count and tries >= count:
                return 0 if ok else 1
            time.sleep(interval_s)  # the refresh period the user asked for


def main(args: argparse.Namespace) -> int:
    """`echo2-hub status` with its parsed arguments."""
    try:
        url = status_url(args.url)
    except ValueError as exc:
        print(f"echo2-hub status: {exc}", file=sys.stderr)
        return 1
    try:
        tls = ssl.create_default_context(cafile=args.ca_cert or None)
    except OSError as exc:  # no such file, or not a PEM
        print(f"echo2-hub status: cannot use --ca-cert {args.ca_cert}: {exc}", file=sys.stderr)
        return 1
    console = Console()

    def fetch_status() -> dict[str, Any]:
        return fetch(url, args.token, tls, args.timeout_s)

    if args.watch is None:
        try:
            console.print(render(fetch_status()))
        except Unreachable as exc:
            print(f"echo2-hub status: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        return watch(fetch_status, args.watch, args.count, console)
    except KeyboardInterrupt:
        return 130
