"""Multi-turn environments as installed packages: found by entry point, never sent over the wire.

An environment package declares an entry point in the group "echo2p2p.environments" naming a
factory (a module-level callable returning a fresh `echo2p2p.episodes.Environment`):

    [project.entry-points."echo2p2p.environments"]
    takeaway = "echo2p2p.tasks.takeaway:make"

The hub names the environment and its version in the welcome; a peer looks the name up here and
refuses to join, with what to install, when it lacks it or has another version. The version is
the environment's `version` attribute, else its distribution's version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

GROUP = "echo2p2p.environments"


@dataclass(frozen=True)
class InstalledEnvironment:
    name: str
    version: str
    factory: Callable[[], Any]  # a fresh environment per episode


class EnvironmentMissing(LookupError):
    """The environment is not installed here, or not in the version asked for."""


def installed() -> list[str]:
    """Names of the environments installed here."""
    return sorted(ep.name for ep in metadata.entry_points(group=GROUP))


def find_environment(name: str) -> InstalledEnvironment:
    """The installed environment `name`; EnvironmentMissing saying what is installed."""
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
