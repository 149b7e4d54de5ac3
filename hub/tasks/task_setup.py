"""What a run trains on and how the hub scores it: the task, the reward, the environment.

`open_setup(cfg, ...)` resolves one `TaskSetup` from the config (the CLI) or from Python objects
(`echo2p2p.hub.api.Run`: reward functions, rows, a `datasets.Dataset`), in this order:
- `env` names an installed multi-turn environment: its seeds are the task, episodes are scored
  by replay, and peers (who play it) claim its rewards;
- rows, a JSONL `task` file whose rows have a "prompt", or a dataset with a "prompt" column
  (TRL's standard or conversational format): users' rows, scored by the reward functions
  (`reward`, ours or TRL's; default "exact_match" against each row's "answer");
- otherwise the built-in addition task, a question/answer JSONL file, a dataset or a
  reasoning-gym generator ("rg:<name>"), scored by the task's own reward (a generator's: full
  credit from its own scorer or nothing, `GeneratorScore`; its partial credit on request)
  unless `reward` names functions to use instead.
Peers learn only the task's kind: one they can score themselves ("addition", "math", an
environment's "env:<name>") makes their claimed rewards checkable; "custom" (users' functions,
which never travel to a volunteer) and "rg:<name>" (scored against the generator's whole entry,
which peers never see, by a package they need not have) they do not score.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2p2p.errors import ConfigError
from echo2p2p.episodes import undetermined
from echo2p2p.adapters.environments import EnvironmentMissing, find_environment
from echo2p2p.scoring.code import code_tests
from echo2p2p.scoring.sandbox import sandbox_refusal
from echo2p2p.scoring.rewards import (BUILTIN, ByAnswer, EpisodeReplay, HubReward,
                                      RewardFunctions, load_reward)
from echo2p2p.adapters.environment_task import EnvironmentTask
from echo2p2p.tasks import REWARDS, AdditionTask, MathTask, Problem, RecordsTask, Task
from echo2p2p.tasks.reasoning import KIND_PREFIX, ReasoningTask, task_options

from ..config import HubConfig
from .dataset_task import open_dataset_task

log = logging.getLogger(__name__)

DETERMINISM_SEEDS = 8  # seeds an environment plays twice over before the hub serves it

RewardSpec = str | Callable[..., Any]


@dataclass(frozen=True)
class TokenizedProblem:
    """A problem and its prompt's ids, as the hub leases it."""

    problem: Problem
    prompt_ids: list[int]


@dataclass(frozen=True)
class TaskSetup:
    """The run's task with what scores it: a setup, not a task (`echo2p2p.tasks` names each
    meaning of "task"); `setup` holds one."""

    task: Task  # problems by split, and a kind
    reward: HubReward  # what the hub's scorers call (`echo2p2p.scoring.rewards`)
    kind: str  # the task kind the welcome tells peers (`Welcome.task_kind`)
    env_version: str = ""  # the environment's, with an environment ('' otherwise)

    @property
    def env(self) -> str:
        return self.task.name if isinstance(self.task, EnvironmentTask) else ""

    @property
    def runs_programs(self) -> bool:
        """The reward runs the completion's program (`code_tests`): its run time is the
        completion's to choose, so the hub's answers are held (`ScoringConfig.code_answer_hold_s`)."""
        funcs = getattr(self.reward, "funcs", ())
        return BUILTIN["code_tests"] in funcs or code_tests in funcs

    def check_runnable(self, unisolated: bool = False) -> None:
        """Raise ConfigError("task") if this reward runs programs and the code sandbox cannot run
        one on this machine (every sample would score 0), or cannot isolate it and `unisolated`
        (--unisolated-code) does not accept that."""
        if self.runs_programs and (why := sandbox_refusal(unisolated=unisolated)) is not None:
            raise ConfigError("task", why)

    @property
    def peers_score(self) -> bool:
        """Peers compute this reward themselves, so a claim above the hub's is a lie."""
        return self.kind in REWARDS or bool(self.env)

    @classmethod
    def builtin(cls, task: Task) -> TaskSetup:
        """A built-in task scored by its own reward (a generator's task: by its scorer)."""
        if isinstance(task, ReasoningTask):
            return cls(task, task.scorer(), task.kind)
        return cls(task, ByAnswer(task.reward), task.kind)


def open_setup(cfg: HubConfig, *, reward: RewardSpec | Sequence[RewardSpec] | None = None,
               reward_weights: Sequence[float] | None = None,
               rows: Iterable[Mapping[str, Any]] | None = None) -> TaskSetup:
    """The run's task and reward: from `cfg`, with Python objects given by the API overriding
    cfg.scoring.reward / cfg.scoring.reward_weights / the task. ConfigError naming the field and the fix."""
    funcs = _reward_functions(cfg, reward)
    weights = list(reward_weights) if reward_weights is not None else _weights(cfg)
    if cfg.tasks.env:
        if funcs or rows is not None:
            raise ConfigError("env", "an environment scores its episodes itself: drop "
                                     "--reward and the dataset, or drop --env")
        return _environment(cfg)
    if rows is not None or _is_records_file(cfg.tasks.task):
        try:
            task = _records(cfg, rows)
        except ValueError as exc:
            raise ConfigError("task", f"{exc}: each row needs a 'prompt' (and the columns "
                                      f"your reward functions read)") from None
        return TaskSetup(task, _functions(funcs or [load_reward("exact_match")], weights),
                         task.kind)
    task = open_task(cfg)
    if isinstance(task, RecordsTask):  # a dataset in TRL's format
        if not funcs and not all("answer" in p.row for p in task.problems("train")):
            raise ConfigError("reward", f"the rows of {cfg.tasks.dataset!r} (a 'prompt' column, "
                                        f"TRL's format) are scored by reward functions: give "
                                        f"--reward module:function (TRL's signature or ours), "
                                        f"or an 'answer' column for exact_match")
        funcs = funcs or [load_reward("exact_match")]
    if not funcs:
        return TaskSetup.builtin(task)
    return TaskSetup(task, _functions(funcs, weights), RecordsTask.kind)


def open_task(cfg: HubConfig) -> Task:
    """The built-in task `cfg` names: a dataset (`echo2p2p.hub.tasks.dataset_task`), the addition
    task, a reasoning-gym generator, or a JSONL math task from a path."""
    if cfg.tasks.dataset:
        return open_dataset_task(cfg.tasks)
    spec = cfg.tasks.task  # the split is the task's own, never cfg.run.seed: the held-out set stays put
    if spec == "addition":
        return AdditionTask()
    if spec.startswith(KIND_PREFIX):
        return _generator_task(cfg)
    path = Path(spec)
    if not path.is_file():
        raise ConfigError("task", f"{spec!r} is not 'addition' and not a JSONL file: give the "
                                  f"path of one, or a dataset with --dataset")
    with path.open(encoding="utf-8") as lines:
        try:
            return MathTask.from_lines(lines)
        except ValueError as e:  # a bad row, named by its line
            raise ConfigError("task", f"{spec}: {e}") from None


def _generator_task(cfg: HubConfig) -> ReasoningTask:
    """The reasoning-gym generator `--task rg:<name>` names, scored strictly unless --task-args
    holds "partial_credit": true (ours: the generator never sees it); ConfigError naming the
    field."""
    try:
        args, partial = task_options(cfg.tasks.generator_args)
        task = ReasoningTask(cfg.tasks.task.removeprefix(KIND_PREFIX), args,
                             eval_size=cfg.tasks.eval_problems, partial_credit=partial)
    except ImportError:
        raise ConfigError("task", "rg:<name> tasks need reasoning-gym: pip install "
                                  "reasoning-gym") from None
    except LookupError as exc:
        raise ConfigError("task", str(exc)) from None
    except ValueError as exc:
        raise ConfigError("task_args", str(exc)) from None
    held = len(task.problems("eval"))
    log.info("%s: %d problems to train on, %d distinct questions held out, scored %s", task.kind,
             len(task.problems("train")), held,
             "with the generator's partial credit" if partial else "full credit or nothing")
    if held < cfg.tasks.eval_problems:
        log.warning("%s makes few distinct questions: %d held out, not --eval-problems %d "
                    "(at most half of them)", task.kind, held, cfg.tasks.eval_problems)
    return task


def _records(cfg: HubConfig, rows: Iterable[Mapping[str, Any]] | None) -> RecordsTask:
    if rows is not None:
        return RecordsTask(rows, eval_size=cfg.tasks.eval_problems)
    with Path(cfg.tasks.task).open(encoding="utf-8") as lines:
        return RecordsTask.from_lines(lines, eval_size=cfg.tasks.eval_problems)


def _environment(cfg: HubConfig) -> TaskSetup:
    """The environment --env names, refused unless its episodes are a function of their seed
    (`episodes.undetermined`: the hub replays each one)."""
    try:
        found = find_environment(cfg.tasks.env)
    except (EnvironmentMissing, ValueError) as exc:
        raise ConfigError("env", str(exc)) from None
    sizes = {}
    if found.seeds is not None:  # rows of its own: held-out ones, else the first few of them
        held, train = found.seeds
        held = held or min(cfg.tasks.eval_problems, train // 2)
        sizes = {"eval_size": held, "train_size": sum(found.seeds) - held}
    why = undetermined(found.factory, range(DETERMINISM_SEEDS))
    if why:
        raise ConfigError("env", f"environment {found.name!r} cannot be replayed: {why}")
    try:
        task = EnvironmentTask(found.name, found.version, found.factory,
                               **({"eval_size": cfg.tasks.eval_problems} | sizes))
    except (TypeError, ValueError) as exc:  # its reset refused a seed, or said no text
        raise ConfigError("env", f"environment {found.name!r} cannot be served: {exc}") from None
    return TaskSetup(task, EpisodeReplay(found.factory), task.kind, found.version)


def _reward_functions(cfg: HubConfig, given: RewardSpec | Sequence[RewardSpec] | None
                      ) -> list[Callable[..., Any]]:
    specs = given if given is not None else [s for s in cfg.scoring.reward.split(",") if s.strip()]
    if callable(specs) or isinstance(specs, str):
        specs = [specs]
    try:
        return [load_reward(s.strip()) if isinstance(s, str) else s for s in specs]
    except ValueError as exc:
        raise ConfigError("reward", str(exc)) from None


def _weights(cfg: HubConfig) -> list[float] | None:
    if not cfg.scoring.reward_weights:
        return None
    try:
        return [float(w) for w in cfg.scoring.reward_weights.split(",")]
    except ValueError:
        raise ConfigError("reward_weights", f"comma-separated numbers, one per --reward "
                                            f"function, got {cfg.scoring.reward_weights!r}") from None


def _functions(funcs: list[Callable[..., Any]], weights: list[float] | None) -> RewardFunctions:
    try:
        return RewardFunctions(funcs, weights)
    except ValueError as exc:
        raise ConfigError("reward_weights" if "weight" in str(exc) else "reward",
                          str(exc)) from None


def _is_records_file(spec: str) -> bool:
    """A JSONL task file whose first row has a "prompt" (question/answer rows are the math
    task's)."""
    path = Path(spec)
    if spec == "addition" or not path.is_file():
        return False
    with path.open(encoding="utf-8") as lines:
        first = next((line for line in lines if line.strip()), "")
    return '"prompt"' in first
