"""Multi-turn environments as installed packages: found by entry point, never sent over the wire.

An environment package declares an entry point in the group "echo2p2p.environments" naming a
factory (a module-level callable returning a fresh `echo2p2p.episodes.Environment`):

    [project.entry-points."echo2p2p.environments"]
    takeaway = "echo2p2p.tasks.takeaway:make"

Environments written for other libraries plug in as they are, by a prefixed name:
`gym:mod:Class` (or `gym:Id-v0`) a Gymnasium text environment (`echo2p2p.adapters.gym_env`),
`verifiers:NAME` an installed verifiers environment (`echo2p2p.adapters.verifiers_env`).

The hub names the environment and its version in the welcome; a peer looks the name up here and
refuses to join, with what to install, when it lacks it or has another version. The version is
the environment's `version` attribute, else its distribution's version; for the prefixed ones,
their module's distribution version (or its source's hash) and the library's.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

GROUP = "echo2p2p.environments"


@dataclass(frozen=True)
class InstalledEnvironment:
    name: str
    version: str
    factory: Callable[[], Any]  # a fresh environment per episode
    # (held-out, training) seeds the environment has, when it has a dataset of its own
    # (verifiers): seeds index its held-out rows, then its training rows; None: any seed
    seeds: tuple[int, int] | None = None


class EnvironmentMissing(LookupError):
    """The environment is not installed here, or not in the version asked for."""


def installed() -> list[str]:
    """Names of the environments installed here."""
    return sorted(ep.name for ep in metadata.entry_points(group=GROUP))


def find_environment(name: str) -> InstalledEnvironment:
    """The installed environment `name`; EnvironmentMissing saying what is installed."""
    if name.startswith(("gym:", "verifiers:")):
        return _adapted(name)
    found = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == name]
    if not found:
        have = ", ".join(installed()) or "none"
        raise EnvironmentMissing(f"environment {name!r} is not installed (installed: {have}); "
                                 f"install the package that provides it (an entry point in "
                                 f"the group {GROUP!r})")
    entry = found[0]
    factory = entry.load()
    env = factory()
    version = str(getattr(env, "version", "") or (entry.dist.version if entry.dist else "0"))
    return InstalledEnvironment(name, version, factory)


def require_environment(name: str, version: str) -> InstalledEnvironment:
    """`find_environment`, and the version the hub runs; EnvironmentMissing in one sentence."""
    try:
        env = find_environment(name)
    except EnvironmentMissing as exc:
        raise EnvironmentMissing(f"this run needs environment {name!r} version {version}, but "
                                 f"{exc}") from None
    if version and env.version != version:
        raise EnvironmentMissing(f"this run needs environment {name!r} version {version}, but "
                                 f"version {env.version} is installed here: install version "
                                 f"{version} of the package that provides it")
    return env


def _adapted(name: str) -> InstalledEnvironment:
    """An environment of another library's, by its prefixed name (`gym:...`, `verifiers:...`)."""
    library = name.split(":", 1)[0]
    try:
        if library == "gym":
            from . import gym_env as adapter
        else:
            from . import verifiers_env as adapter
    except ImportError as exc:
        package = "gymnasium" if library == "gym" else "verifiers"
        raise EnvironmentMissing(f"{name!r} needs {package}, which is not importable here "
                                 f"({exc}): pip install {package}") from None
    try:
        loaded = adapter.load(name)
    except LookupError as exc:
        raise EnvironmentMissing(str(exc)) from None
    version = f"{module_version(loaded.module)}, {adapter.LIBRARY} {adapter.VERSION}"
    return InstalledEnvironment(name, version, loaded.factory, loaded.seeds)


def module_version(module: str) -> str:
    """The version of the distribution that installed `module`, else "source <hash>" of its
    file (a module on the path but in no distribution: peers then need the same file)."""
    top = module.split(".")[0]
    dists = metadata.packages_distributions().get(top)
    if dists:
        return metadata.version(dists[0])
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin) if spec and spec.origin else None
    if origin is None or not origin.is_file():
        return "0"
    return "source " + hashlib.sha256(origin.read_bytes()).hexdigest()[:12]
