"""verifiers environments (prime-rl's, the Environments Hub's) as episodes: `--env verifiers:NAME`.

`NAME` is what verifiers' own `load_environment(NAME)` takes: an installed module (dashes read
as underscores) whose `load_environment()` returns a classic verifiers environment
(`vf.SingleTurnEnv`, `vf.MultiTurnEnv` and their kin: verifiers < 0.4, which 0.3 keeps as
`verifiers.legacy`). Its rows are the run's problems: seed i is the i-th of its held-out rows
(`eval_dataset`) and then its training rows (`dataset`), and a problem's prompt is its row's
messages (system prompt and few-shot included), which the chat template renders.

An episode is the environment's own `rollout`, as prime-rl runs it, except that the model's turns
come from `step`: `_Turns`, a verifiers Client, answers each model call with the action `step`
was given. So `setup_state`, `env_response`, the stop conditions (`max_turns`, `@vf.stop`, a
final env response) and the cleanup handlers all run as they do there. When the rollout ends
its rubric scores it (`score_rollout`: every reward function, weighted) and the reward comes on
the last turn. The environment's messages after a model turn (user or tool) are the next
observation: their text contents, one per line, which a run under a chat template wraps as a
user turn (`user_turns`, `PromptFormat.observation_turn`).

verifiers' Environment installs its own SIGINT and SIGTERM handlers when it is made (a teardown,
then exit): they would take the hub's clean stop away, and they fail off the main thread. The
adapter keeps the process's handlers: verifiers' module sees a `signal` whose `signal` does
nothing (its atexit teardown still runs).

Left as they are not: group reward functions (a rubric over a prompt's G rollouts: refused),
tool calls (a model turn is text), and `timeout_seconds` (a wall clock: the hub's replay would
disagree with the peer's play; switched off).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
import types
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import verifiers as vf
import verifiers.envs.environment as vf_environment
from verifiers.types import Response, ResponseMessage
from verifiers.utils.env_utils import env_module_name

from echo2p2p.episodes import MAX_TURNS, Step
from echo2p2p.tasks.records import conversation_text

PREFIX = "verifiers:"
LIBRARY, VERSION = "verifiers", vf.__version__
MODEL = "echo2p2p"  # the model name the environment's state records

vf_environment.signal = types.SimpleNamespace(  # the process's handlers stay (see above)
    signal=lambda *args: None, SIGINT=signal.SIGINT, SIGTERM=signal.SIGTERM,
    default_int_handler=signal.default_int_handler)


# `Any` in this module is verifiers' own (its messages, clients, responses, environments),
# which that library does not type in a way we can import without it.
def plain(message: Any) -> dict[str, str]:
    """A verifiers message (a dict or a pydantic model) as {"role", "content"}."""
    get = message.get if isinstance(message, dict) else lambda k: getattr(message, k, None)
    return {"role": str(get("role")), "content": _content(message)}


def _content(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else message.content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") or ""
                       for p in content)
    return content or ""


class _Turns(vf.Client):
    """The model's side of a rollout: each response is the action the episode's `step` got."""

    def __init__(self, episode: VerifiersEpisode):
        super().__init__(object())
        self.episode = episode

    async def get_response(self, prompt: Any, model: str, sampling_args: Any,
                           tools: Any = None, **kwargs: Any) -> Response:
        action = await self.episode.ask(prompt)
        message = ResponseMessage(content=action, finish_reason="stop", is_truncated=False)
        return Response(id="echo2p2p", created=0, model=model, message=message)

    # A client that calls no provider: verifiers' provider hooks are never reached.
    def setup_client(self, config: Any) -> Any:
        raise NotImplementedError

    async def to_native_tool(self, tool: Any) -> Any:
        raise NotImplementedError

    async def to_native_prompt(self, messages: Any) -> Any:
        raise NotImplementedError

    async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def raise_from_native_response(self, response: Any) -> None:
        raise NotImplementedError

    async def from_native_response(self, response: Any) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class VerifiersEpisode:
    """One rollout of a verifiers environment, stepped: an `echo2p2p.episodes.Environment`."""

    user_turns = True  # under a chat template, each observation is a user turn

    def __init__(self, env: Any, rows: Sequence[dict]):
        self.env, self.rows = env, rows
        self.max_turns = min(env.max_turns, MAX_TURNS) if env.max_turns > 0 else MAX_TURNS
        self.rollout: asyncio.Task | None = None

    def opening(self, seed: int) -> list[dict[str, str]]:
        """The conversation seed `seed` starts from (its row's prompt), without playing it."""
        return [plain(m) for m in self._row(seed)["prompt"]]

    def reset(self, seed: int) -> str:
        """Start seed `seed`'s rollout on this thread's loop (`step` it on the same thread)."""
        self.close()
        self.loop = _thread_loop()
        self.asked: asyncio.Future = self.loop.create_future()
        self.rollout = self.loop.create_task(self._play(dict(self._row(seed))))
        prompt = self._until_asked()
        if prompt is None:
            raise ValueError(f"the verifiers environment ended seed {seed}'s rollout before the "
                             f"model's first turn")
        self.said = [plain(m) for m in prompt]
        return conversation_text(self.said)

    def step(self, action: str) -> Step:
        self.answer.set_result(action)
        prompt = self._until_asked()
        if prompt is None:  # the rollout ended: the rubric has scored it
            reward = float(self.rollout.result()["reward"])
            self.close()
            return Step("", reward, True)
        said = [plain(m) for m in prompt]
        turn = self.said + [{"role": "assistant", "content": action}]
        if said[:len(turn)] != turn:
            raise ValueError("the verifiers environment rewrote the conversation between turns "
                             "(a non-linear get_prompt_messages): only appended messages can be "
                             "replayed as tokens")
        self.said = said
        return Step(conversation_text(said[len(turn):]), 0.0, False)

    async def ask(self, prompt: Any) -> str:
        """The model's next turn on `prompt`: what the next `step` brings."""
        self.answer: asyncio.Future = self.loop.create_future()
        self.asked.set_result(prompt)
        return await self.answer

    async def _play(self, row: dict) -> Any:
        state = await self.env.rollout(row, _Turns(self), MODEL, {})
        if state.get("error") is not None:
            raise ValueError(f"the verifiers environment's rollout failed: {state['error']!r}")
        await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        return state

    def _until_asked(self) -> Any:
        """Run the rollout until the model's next turn (its prompt) or its end (None)."""
        self._run(asyncio.wait([self.asked, self.rollout],
                               return_when=asyncio.FIRST_COMPLETED))
        if not self.asked.done():
            self.rollout.result()  # the rollout's own error, if it failed
            return None
        prompt, self.asked = self.asked.result(), self.loop.create_future()
        return prompt

    def _run(self, awaitable: Awaitable[Any]) -> Any:
        """Run our loop until `awaitable` is done; from a thread whose own loop is running (the
        hub's start-up), on a helper thread."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self.loop.run_until_complete(awaitable)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(self.loop.run_until_complete, awaitable).result()

    def _row(self, seed: int) -> dict:
        if not 0 <= seed < len(self.rows):
            raise ValueError(f"seed {seed} is past the environment's {len(self.rows)} rows")
        return self.rows[seed]

    def close(self) -> None:
        """Drop a rollout still running (an episode replayed only in part)."""
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()
            self._run(asyncio.gather(self.rollout, return_exceptions=True))
        self.rollout = None

    def __del__(self) -> None:
        if self.rollout is not None:
            self.rollout.cancel()  # its loop runs the cancellation when it next runs


_loops = threading.local()


def _thread_loop() -> asyncio.AbstractEventLoop:
    """This thread's event loop for rollouts, shared by its episodes: a loop (and its executor
    thread, which verifiers uses on every turn) per episode costs more than the rollout."""
    loop = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _loops.loop = asyncio.new_event_loop()
    return loop


class Episodes:
    """Fresh episodes of one verifiers environment, loaded once per process. It pickles as its
    id: a scoring worker loads the environment again when it unpickles it, at its start, not
    under a sample's deadline."""

    def __init__(self, env_id: str):
        self.env_id = env_id
        self.env, self.rows, self.held = _open(env_id)

    def __call__(self) -> VerifiersEpisode:
        return VerifiersEpisode(self.env, self.rows)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return Episodes, (self.env_id,)


@dataclass(frozen=True)
class Loaded:
    module: str  # the environment's module (its version is the distribution's)
    factory: Episodes
    seeds: tuple[int, int]  # held-out rows, training rows


def load(name: str) -> Loaded:
    """`verifiers:NAME`, loaded here once. LookupError when it is not installed; ValueError
    when verifiers loads it but it cannot be replayed here."""
    env_id = name.removeprefix(PREFIX)
    episodes = Episodes(env_id)
    held, train = episodes.held, len(episodes.rows) - episodes.held
    return Loaded(env_module_name(env_id), episodes, (held, train))


def _open(env_id: str) -> tuple[Any, list[dict], int]:
    """The environment `env_id`, its rows (held-out first) and how many are held out."""
    name = PREFIX + env_id
    try:
        env = vf.load_environment(env_id)
    except (ValueError, ImportError) as exc:  # verifiers' words for "not installed"
        raise LookupError(f"environment {name!r}: {exc}") from None
    except RuntimeError as exc:  # its load_environment raised: verifiers' words for it
        raise ValueError(str(exc)) from None
    if env.rubric._get_group_reward_funcs():
        raise ValueError(f"environment {name!r} scores rollouts as a group (a group reward "
                         f"function): the hub scores each episode alone, so it cannot run here")
    env.timeout_seconds = None  # a wall clock would make the hub's replay differ from the play
    held = [dict(r) for r in env.build_eval_dataset() or ()]
    return env, held + [dict(r) for r in env.build_dataset() or ()], len(held)
