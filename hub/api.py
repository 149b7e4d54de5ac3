"""The Python API: a run defined in a script, served as `echo2-hub serve` or `demo` serves it.

    from echo2p2p.hub import Run

    def short(prompt, completion, row):          # a reward function of your own
        return 1.0 if len(completion.strip()) <= 2 else 0.0

    if __name__ == "__main__":                    # the scoring workers import this file
        Run(reward=short, max_steps=30).demo(peers=2)

`Run` takes the fields of `echo2p2p.hub.config.HubConfig`'s sections as keywords, by their flat
names (`lr=`, `max_lag=`), or a `HubConfig`, or a mapping of them (flat, or section tables): the
same fields and defaults as the command line's flags, which call this
class: the CLI is a thin caller of it. Besides them it takes what a command line cannot carry:
reward functions as Python callables (`reward`, `reward_weights`; ours, (prompt, completion,
row), or TRL's, (prompts, completions, **columns)) and rows as Python objects (`dataset`: a list
of dicts, a `datasets.Dataset`, any iterable of mappings with a "prompt": text, or TRL's
conversational messages); a `dataset` given as a string is the `--dataset` field (a file,
folder or cached hub name).
A run on an environment names it (`env="takeaway"`): peers install environments as packages.

`serve()` trains until `max_steps` with whatever peers join; `demo()` also starts local peer
processes, with the demo's defaults (`DEMO_DEFAULTS`) for the fields not given. Both return the
step records this call trained (what it appended to metrics.jsonl: a resumed run's earlier steps
are in the log, not in the list). Under torchrun (`--nproc-per-node N`) every rank
calls the same method: rank 0 serves, the others follow it and return [].
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from echo2p2p.config import as_dict, resolve
from echo2p2p.errors import ConfigError
from echo2p2p.runtime import process

from .config import DEMO_DEFAULTS, HubConfig
from .config_presets import all_sources, fill, flatten


class Run:
    """One training run: its config, its reward functions and its rows."""

    def __init__(self, config: HubConfig | Mapping[str, Any] | None = None, *,
                 reward: Any = None, reward_weights: Sequence[float] | None = None,
                 dataset: Iterable[Mapping[str, Any]] | None = None,
                 sources: Mapping[str, str] | None = None, **fields: Any):
        """ConfigError naming the field (and the fix) for a bad value or an unknown name.
        The fields not given (a `HubConfig`'s: those at their default) take the model's preset
        or derived values (`hub.config_presets`); `sources` says where the given ones came from
        (the command line: "flag", "file PATH"; default "python")."""
        table = dict(config or {}) if not isinstance(config, HubConfig) else dict(
            as_dict(config).items() - as_dict(HubConfig()).items())  # what it changed
        table.pop("run_id", None)
        if isinstance(reward, str):  # as the command line gives it: a config field
            fields["reward"], reward = reward, None
        if isinstance(dataset, (str, Path)):  # a file, folder or hub name: --dataset's
            fields["dataset"], dataset = str(dataset), None
        if isinstance(reward_weights, str):
            fields["reward_weights"], reward_weights = reward_weights, None
        if reward_weights is not None and reward is None and not fields.get("reward"):
            raise ConfigError("reward_weights", "weights need reward functions to weigh")
        self._table = {**table, **fields}
        self._sources = dict(sources or {})
        self.config, self.sources = self.resolved()
        self.reward, self.reward_weights = reward, reward_weights
        self.dataset = None if dataset is None else [dict(row) for row in dataset]

    def resolved(self, defaults: Mapping[str, Any] | None = None) -> tuple[HubConfig, dict[str, str]]:
        """The config (the fields given, the model's preset or derived values under them, then
        `defaults`) and where each of its fields came from."""
        table, sources = fill(self._table, self._sources, defaults)
        cfg = resolve(HubConfig, table)
        return cfg, all_sources(cfg, sources)

    def setup(self, cfg: HubConfig | None = None) -> Any:
        """The task and reward this run trains on (`hub.tasks.task_setup.TaskSetup`)."""
        from .tasks.task_setup import open_setup

        return open_setup(cfg or self.config, reward=self.reward,
                          reward_weights=self.reward_weights, rows=self.dataset)

    def serve(self, *, resume: str | Path | None = None) -> list[dict[str, Any]]:
        """Serve peers and train until max_steps; `resume`: a run directory to continue from
        its last checkpoint (its saved config, overridden by the fields given here). SIGINT or
        SIGTERM stops it cleanly (checkpointed): `echo2p2p.hub.run.Stopped` is raised."""
        from .run import run

        cfg, sources = self._resumed(resume) if resume is not None else (self.config, self.sources)
        return _launch(cfg, lambda ranks: run(
            cfg, resume=Path(resume) if resume is not None else None, ranks=ranks,
            setup=lambda: self.setup(cfg), sources=sources,
            scripted=self._scripted))  # the setup is made once the ports are bound

    def demo(self, peers: int = 2, *, engine: str = "transformers", peer_python: str = "",
             resume: str | Path | None = None) -> list[dict[str, Any]]:
        """The hub and `peers` local peer processes (`engine`: transformers or vllm, under
        `peer_python`), with the demo's defaults for the fields not given; `resume`: a run
        directory to continue, as `serve` does."""
        from .run import peer_python as find_python
        from .run import run

        if peers < 1:
            raise ValueError(f"peers must be >= 1, got {peers}")
        cfg, sources = self._resumed(resume) if resume is not None else self.resolved(DEMO_DEFAULTS)
        python = find_python(engine, peer_python)
        return _launch(cfg, lambda ranks: run(
            cfg, local_peers=peers, engine=engine, python=python, ranks=ranks, setup=lambda: self.setup(cfg),
            sources=sources, resume=Path(resume) if resume is not None else None,
            scripted=self._scripted))

    @property
    def _scripted(self) -> bool:
        """Its reward or rows are Python objects: only the script can resume it."""
        return callable(self.reward) or self.reward_weights is not None or self.dataset is not None

    def _resumed(self, resume: str | Path) -> tuple[HubConfig, dict[str, str]]:
        """The config saved in `resume` with the fields given here on top, and their sources."""
        cfg = resume_config(Path(resume), self._table)
        saved, given = f"file {Path(resume) / 'config.json'}", flatten(self._table)
        return cfg, {k: self._sources.get(k, "python") if k in given else saved
                     for k in self.sources}


def saved_config(run_dir: Path) -> dict[str, Any]:
    """The config fields a run saved in `run_dir`, its run directory set to it (its run id is
    the checkpoint's, not a field)."""
    import json

    if not (run_dir / "config.json").is_file():
        why = "it has no config.json" if run_dir.is_dir() else "no such directory"
        raise FileNotFoundError(f"no run to resume in {run_dir}: {why} (give --resume the run "
                                f"directory the hub printed when it started)")
    saved = json.loads((run_dir / "config.json").read_text())
    saved.pop("run_id", None)
    return {**saved, "run_dir": str(run_dir)}


def resume_config(run_dir: Path, overrides: Mapping[str, Any]) -> HubConfig:
    """The config saved in `run_dir`, with `overrides` on top and the run directory set."""
    return resolve(HubConfig, {**saved_config(run_dir), **overrides, "run_dir": str(run_dir)})


def _launch(cfg: HubConfig, serve: Callable[[Any], Any]) -> list[dict[str, Any]]:
    """`serve(ranks)` on this process's event loop, or, a rank other than 0 of a sharded
    learner (torchrun), follow rank 0 until it stops."""
    from .learning.ranks import Ranks
    from .run.start import follow_rank

    ranks = Ranks.from_env(cfg)  # None unless launched by torchrun with several ranks
    _show_dashboard_url()
    try:
        if ranks is None:
            return process.run(serve(None))
        ranks.agree(as_dict(cfg))
        _stop_quietly_on_sigterm(ranks.rank, cfg.run.run_dir)
        if ranks.rank > 0:
            follow_rank(cfg, ranks)
            return []
        return process.run(serve(ranks))
    finally:
        if ranks is not None:
            ranks.close()


def _show_dashboard_url() -> None:
    """The CLI logs "dashboard on URL" (its main configures logging); a script that configured
    none would never see it: that one logger's lines go to stdout, as the CLI shows them."""
    if logging.getLogger().handlers:
        return  # the script's own logging shows it
    logger = logging.getLogger("echo2p2p.hub.view.dashboard")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _stop_quietly_on_sigterm(rank: int, run_dir: str) -> None:
    """torchrun ends every rank with SIGTERM when one of them fails: say so, and how to go on.
    Exits at once: a thread may be inside a collective that will never finish, and the run
    directory is consistent at any moment (its journal is flushed record by record)."""
    from .run import stop_local_peers

    where = run_dir or "RUN_DIR (the run directory the hub printed at start-up)"

    def stop(signum: int, frame: Any) -> None:
        stop_local_peers()
        os.write(2, (f"echo2-hub: learner rank {rank} stopped by the launcher (torchrun stops "
                     f"every rank when one fails; its report names the first). Resume with "
                     f"`echo2-hub serve --resume {where}`, on any rank count that divides "
                     f"the batch\n").encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
