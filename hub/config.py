"""The hub's configuration: every knob of `echo2-hub serve`, in sections, with its help text.

`HubConfig` holds one frozen section of each kind (`echo2p2p.hub.config_sections`), and a part
of the hub is given the section it reads (`cfg.staleness.max_lag`, `Door(cfg.limits, ...)`).
Outside, names stay flat: flags (`--lr`), TOML keys (`lr = 0.01`, or in a `[hub.grpo]` table),
`Run(lr=...)`, `HubConfig.from_flat(lr=...)`, `cfg.replace(lr=...)` and the saved config.json.
The fields a user does not set take the model's preset or values derived from its size
(`echo2p2p.hub.config_presets`, which also says where each value came from).
Light to import: `--help` is answered before anything heavy loads.
"""

from __future__ import annotations

import inspect
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2p2p import config as configs
from echo2p2p.config import field_docs
from echo2p2p.errors import ConfigError

from .config_grpo import GrpoConfig
from .config_memory import MemoryConfig
from .config_sections import (LearnerConfig, LimitsConfig, NetworkConfig, OverlayConfig,
                              RunConfig, ScoringConfig, StalenessConfig, TasksConfig,
                              TrustConfig, ViewConfig)


SECRETS = ("dashboard_token",)  # never written to the run dir nor sent to a tracker
# `demo` (and `Run.demo`) differ from `serve` in these defaults only.
DEMO_DEFAULTS = {"port": 0, "max_steps": 150, "torch_threads": 1, "eval_every": 10}


@dataclass(frozen=True)
class HubConfig:
    """Every knob of the hub, by section; `--help` lists them in this order."""

    run: RunConfig = field(default_factory=RunConfig)
    """The policy trained, its seed and length, where it is saved."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The peers' port: address, TLS, join tokens, heartbeats."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    """What to train on, its prompts and held-out set."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Reward functions, their workers and deadlines."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """Groups, batch, optimizer, sampling."""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    """S and kappa, leases, which peers generate."""
    overlay: OverlayConfig = field(default_factory=OverlayConfig)
    """Versions: their format, how they reach peers, what the hub keeps."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Where and how a learner step is computed."""
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    """What one peer, address or join token may cost the hub."""
    trust: TrustConfig = field(default_factory=TrustConfig)
    """Spot-checks of peers' logprobs."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The memory budget the hub fits into; the time-based checkpoint cadence."""
    view: ViewConfig = field(default_factory=ViewConfig)
    """The dashboard and experiment trackers."""

    @classmethod
    def from_flat(cls, **fields: Any) -> HubConfig:
        """The config with the fields named (flat names, as flags and TOML keys) set, each
        section checked; values are used as given (`resolve` converts strings)."""
        return configs.from_flat(cls, fields)

    def replace(self, **fields: Any) -> HubConfig:
        """This config with the fields named (flat names) changed, the sections checked again."""
        return configs.replace(self, **fields)


def help_texts(cls: type) -> dict[str, str]:
    """The `--help` text of each field of config class `cls`, or of each field of its sections:
    the docstring under it, read from the class's source file (the core's `field_docs` parses
    the text)."""
    kinds = configs.sections(cls).values() or (cls,)
    return {name: doc for kind in kinds for name, doc in field_docs(inspect.getsource(kind)).items()}


def read_toml(path: Path, field: str = "config") -> dict[str, Any]:
    """The TOML file at `path`; ConfigError on `field` (the flag that named it) when it is
    missing, unreadable or not TOML, naming the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(field, f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, f"cannot read {path}: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # "Invalid value (at line 3, column 7)"
        what, _, where = str(exc).rpartition(" (at ")
        where = where.rstrip(")") if what else ""
        raise ConfigError(field, f"{path}: {where + ': ' if where else ''}{what or exc}"
                                 " (not valid TOML)") from None
