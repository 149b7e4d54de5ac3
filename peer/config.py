"""The peer's configuration: every knob of `echo2-peer join`, with its help text.

`PeerConfig` is flat (a peer has 30 knobs, its parts read a few each); `GROUPS` only sorts its
flags into the groups `echo2-peer join --help` shows.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from echo2p2p import messages as m
from echo2p2p.bounds import check_from_peer
from echo2p2p.config import field_docs
from echo2p2p.errors import ConfigError, RemoteProtocolError
from echo2p2p.policy.devices import check_device
from echo2p2p.runtime.tcp import check_congestion
from echo2p2p.messages import ENGINES  # the wire's list: the hub refuses any other engine

DTYPES = ("", "float32", "bfloat16")  # PeerConfig.dtype: torch's names of what engines run in


# `echo2-peer join --help` in these groups: title -> (what they are, the fields).
GROUPS = {
    "hub": ("The hub: how to reach it, trust it, and tell it is alive.",
            "hub_url hub_key token ca_cert connect_timeout_s reconnect_max_s heartbeat_s "
            "hub_timeout_s max_frame_bytes"),
    "worker": ("This worker: its engine, its price, the leases it holds, how it scores.",
               "engine device dtype torch_threads price_per_hour name leases_in_flight "
               "score_timeout_s model_cache"),
    "relay": ("Versions: relaying them to other peers, and what this peer keeps.",
              "listen advertise upload_limit_mbps tcp_congestion keep_versions relay_stall_s "
              "gossip_degree gossip_max_links"),
    "outbox": ("Rollouts waiting for the hub's answer.", "outbox_memory_mb outbox_max spool_dir"),
    "metrics": ("This peer's Prometheus /metrics.", "metrics_port metrics_host"),
}


@dataclass(frozen=True)
class PeerConfig:
    hub_url: str = "ws://127.0.0.1:8765/ws"
    """The hub to join: ws://HOST:PORT/ws (http://HOST:PORT or HOST:PORT also work)."""
    engine: str = "transformers"
    """Rollout engine: transformers (CPU or GPU), vllm (GPU with the vllm extra; CPU under the
    venv of .ci/vllm-env), or relay (no rollouts: only receive and pass on versions, e.g. on a
    well-connected machine without a GPU)."""
    device: str = "cpu"
    """Where the engine runs: cpu, cuda, cuda:1."""
    dtype: str = ""
    """What the engine computes in: float32 or bfloat16 ('' = the engine's default: float32 for
    transformers, for vLLM float32 on a CPU and bfloat16 on a GPU). bfloat16: half the memory
    and faster on a GPU; its logprobs drift from the learner's fp32 (SmolLM2-135M: 0.03 nats a
    token on average, 0.033 at most over a group), far under the hub's spot-check bar (0.2 by
    default; the welcome says it; bench/logprob_drift.py)."""
    price_per_hour: float = 0.0
    """What this worker costs, in $/h, for the hub's cost-aware activation."""
    name: str = ""
    """A name for logs ('' = hostname-pid)."""
    leases_in_flight: int = 2
    """Prompt leases to hold at once: one generating, the rest queued so the engine never idles."""
    torch_threads: int = 0
    """Threads for torch (0 = torch's default); 1 when several peers share a CPU. With --engine
    vllm on a CPU they are set before torch loads (OMP_NUM_THREADS, which every thread of
    vLLM's follows): vLLM's CPU worker refuses a change once it started."""
    connect_timeout_s: float = 30.0
    """Give up on one connection attempt (and its welcome) after this long."""
    reconnect_max_s: float = 30.0
    """Longest wait between reconnection attempts (backoff doubles up to this)."""
    heartbeat_s: float = 10.0
    """Seconds between heartbeats to the hub."""
    hub_timeout_s: float = 30.0
    """A hub silent this long is treated as gone: disconnect and reconnect."""
    max_frame_bytes: int = 8 << 20
    """Largest frame accepted from the hub (the largest is a version's manifest, ~75 bytes a chunk)."""
    hub_key: str = ""
    """Pin the hub's public key (hex, as the hub logs it): refuse any hub that signs with another."""
    token: str = ""
    """Join token from the hub's operator (`echo2-hub token create`), if the hub requires one."""
    ca_cert: str = ""
    """PEM file of the certificate authority to trust for a wss:// hub with a private or
    self-signed certificate ('' = the system's trusted authorities)."""
    listen: str = "0.0.0.0:0"
    """HOST:PORT of this peer's chunk server, which relays versions to other peers (port 0 = any
    free port). '' = serve nothing: a leaf that only pulls (behind NAT, say)."""
    advertise: str = ""
    """URL other peers reach the chunk server at, e.g. http://203.0.113.7:7000 ('' = the listen
    address, or for 0.0.0.0 the address of the interface that routes to the hub)."""
    upload_limit_mbps: float = 0.0
    """Cap on this peer's upload to other peers, in Mbit/s (0 = no cap)."""
    tcp_congestion: str = "cubic"
    """TCP congestion control of the sockets that carry chunks from this peer ('' = the
    machine's default; see echo2p2p.runtime.tcp for why cubic)."""
    keep_versions: int = 3
    """Versions to keep (to serve, and as bases of deltas); each costs one copy of the weights in RAM."""
    relay_stall_s: float = 10.0
    """A source that makes no progress on a chunk for this long is reported and skipped."""
    gossip_degree: int = 8
    """With a hub on --relay gossip: links this peer dials (to the neighbours the hub sampled and
    the ones it hears of). A peer with --listen '' (behind NAT) still serves over these."""
    gossip_max_links: int = 24
    """With --relay gossip: most links this peer keeps, dialled and accepted together."""
    outbox_memory_mb: float = 64.0
    """Rollouts waiting for the hub's answer (it is away, or has not acked yet) are kept in
    memory up to this many MiB, then spilled to files in --spool-dir; all are sent again on
    reconnect."""
    outbox_max: int = 4096
    """Most unanswered rollouts to keep; past it the oldest is dropped (its prompt is re-issued)."""
    spool_dir: str = ""
    """Where rollouts past --outbox-memory-mb go ('' = the system's temporary directory)."""
    model_cache: str = ""
    """Where the model's config and tokenizer files fetched from hubs are kept, one directory
    per signed index, so a rejoin fetches nothing again ('' = $XDG_CACHE_HOME/echo2p2p/models,
    else ~/.cache/echo2p2p/models). A vLLM peer keeps vLLM's compile cache in its `vllm`
    folder: a restart loads the compiled model instead of compiling it again."""
    score_timeout_s: float = 5.0
    """Deadline for scoring one completion (the reward this peer claims), in a worker process
    off the event loop; past it the worker is killed and the completion claims 0."""
    metrics_port: int = -1
    """TCP port of this peer's Prometheus /metrics (0 = a free one, the log prints the URL;
    -1 = none). It shows this peer's own counters only: no keys, no other peer's address."""
    metrics_host: str = "127.0.0.1"
    """Address the peer's /metrics listens on (0.0.0.0 for a Prometheus on another machine)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError("engine", f"one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError("engine", f"vLLM is not installed in {sys.executable}: pip install "
                                        "'echo2p2p[vllm]' on a GPU machine; on a CPU one run "
                                        ".ci/vllm-env and start .venv-vllm/bin/echo2-peer")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"one of {', '.join(DTYPES[1:])} or '' (the engine's "
                                       f"default), got {self.dtype!r}")
        if self.price_per_hour < 0:
            raise ConfigError("price_per_hour", f"must be >= 0, got {self.price_per_hour}")
        if self.leases_in_flight < 1:
            raise ConfigError("leases_in_flight", f"must be >= 1, got {self.leases_in_flight}")
        if self.outbox_max < 1 or self.outbox_memory_mb < 0:
            raise ConfigError("outbox_max" if self.outbox_max < 1 else "outbox_memory_mb",
                              "must be >= 1 (outbox_max) and >= 0 (outbox_memory_mb)")
        if self.keep_versions < 2:
            raise ConfigError("keep_versions", f"must be >= 2 (a delta needs its base), got {self.keep_versions}")
        if not 1 <= self.gossip_degree <= self.gossip_max_links <= 256:
            raise ConfigError("gossip_degree" if self.gossip_degree < 1 else "gossip_max_links",
                              "need 1 <= gossip_degree <= gossip_max_links <= 256, got "
                              f"{self.gossip_degree} and {self.gossip_max_links}")
        if self.upload_limit_mbps < 0:
            raise ConfigError("upload_limit_mbps", f"must be >= 0, got {self.upload_limit_mbps}")
        if not -1 <= self.metrics_port < 65536:
            raise ConfigError("metrics_port", f"a TCP port, 0 (a free one) or -1 (none), got "
                                              f"{self.metrics_port}")
        if self.advertise and not self.advertise.startswith(("http://", "https://")):
            raise ConfigError("advertise", f"expected http://HOST:PORT, got {self.advertise!r}")
        self.listen_host_port  # noqa: B018  (parsed now, so a bad address fails at start)
        if self.engine != "relay":  # a relay runs no model
            check_device(self.device)  # before joining: a CPU-only torch cannot take "cuda"
        for name in ("connect_timeout_s", "reconnect_max_s", "heartbeat_s", "hub_timeout_s",
                     "relay_stall_s", "score_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.score_timeout_s == float("inf"):  # a deadline that never comes is none
            raise ConfigError("score_timeout_s", "must be finite")
        normalize_url(self.hub_url)
        check_congestion(self.tcp_congestion)
        if self.ca_cert and not os.path.isfile(self.ca_cert):
            raise ConfigError("ca_cert", f"no such file: {self.ca_cert}")
        self.pinned_hub_key  # noqa: B018  (parsed now, so a bad pin fails at start naming hub_key)
        # The hub refuses a hello outside echo2p2p.bounds (a NaN price, a long name): refuse it
        # here, naming the flag, rather than reconnect to the same refusal forever.
        try:
            check_from_peer(m.Hello(self.display_name, self.engine, self.device,
                                    self.price_per_hour, self.advertise or None, self.token,
                                    dtype=self.engine_dtype), None)
        except RemoteProtocolError as exc:
            name = exc.reason.removeprefix("bad field hello.").split(":")[0]
            raise ConfigError("advertise" if name == "listen_addr" else name, exc.reason) from None

    @property
    def engine_dtype(self) -> str:
        """The dtype the engine computes in, as the hello says it ('' for a relay)."""
        if self.engine == "relay":
            return ""
        if self.dtype:
            return self.dtype
        return "float32" if self.engine == "transformers" or self.device == "cpu" else "bfloat16"

    @property
    def pinned_hub_key(self) -> bytes | None:
        """The pinned hub key as raw bytes, or None when nothing is pinned."""
        if not self.hub_key:
            return None
        try:
            key = bytes.fromhex(self.hub_key)
        except ValueError:
            key = b""
        if len(key) != 32:
            raise ConfigError("hub_key", "expected 64 hex digits (a 32-byte Ed25519 key)")
        return key

    @property
    def listen_host_port(self) -> tuple[str, int]:
        """`listen` split into host and port."""
        host, _, port = self.listen.rpartition(":")
        if not self.listen:
            return "", 0
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError("listen", f"expected HOST:PORT, got {self.listen!r}")
        return host.strip("[]"), int(port)

    @property
    def model_cache_dir(self) -> Path:
        """`model_cache`, or the default under the user's cache directory."""
        if self.model_cache:
            return Path(self.model_cache).expanduser()
        root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(root) / "echo2p2p" / "models"

    @property
    def display_name(self) -> str:
        return self.name or f"{socket.gethostname()}-{os.getpid()}"


def normalize_url(url: str) -> str:
    """ws://HOST:PORT/ws from any of the accepted spellings."""
    if "://" not in url:
        url = "ws://" + url
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ConfigError("hub_url", f"expected ws://HOST:PORT/ws, got {url!r}")
    return f"{scheme}://{parts.netloc}{parts.path if parts.path not in ('', '/') else '/ws'}"


def help_texts(cls: type) -> dict[str, str]:
    """The `--help` text of each field of config class `cls`: the docstring under it, read from
    the class's source file (the core's `field_docs` parses the text)."""
    return field_docs(inspect.getsource(cls))
