"""What the adapters cost the hub's scoring: TRL rewards, verifiers and Gymnasium against native.

Each arm is one task written twice, through an adapter and in our own contract, scored on the
same completions or episodes the way a scoring worker scores them (`score_item` of
`echo2p2p.scoring.worker`, in this process: the pipe to a worker carries the same items either
way). A group is G = 8 samples. Arms (native | adapter):

  trl          `f(prompt, completion, row)` | TRL's `f(prompts, completions, completion_ids,
               **columns)`, both in `RewardFunctions` (the TRL one on a batch of one, ids given)
  vf single    that native function, on the text | verifiers:tests.envs.vf_sums (SingleTurnEnv,
               parser, weighted rubric) replayed by `EpisodeReplay`, rollout and rubric included
  vf multi     `NativeGuess`, an `episodes.Environment` | verifiers:verifiers_guess (MultiTurnEnv),
               both replayed by `EpisodeReplay`
  gym          `NativeBlackjack`, an `episodes.Environment` driving gymnasium's Blackjack-v1 itself
               | gym:gym_blackjack:BlackjackText through `GymText`; both make Blackjack-v1 per
               episode, so the gap is the adapter's own (GymText and the gym.Env wrapper)

Episodes are played first (`episodes.play`, the adapter's environment, the tiny model's char
tokenizer) with scripted seeded-random turns, legal and illegal, each ending in EOS as a model
turn does; every score is then checked: OK, the played reward, native equal to adapter. Timing
interleaves the arms in rounds (native and adapter alternating first); each figure is the
median over rounds of ms per group, the ratio the median of the rounds' adapter/native.

One-time costs, each in a fresh process (median of --cold-repeats): importing the adapter
(its library included; for gym also gymnasium alone, which the native needs too), loading the
environment (`find_environment`) and the hub's determinism check (`episodes.undetermined`,
8 seeds), which the natives take too.

    python bench/adapter_cost.py [--groups 960] [--rounds 24] [--cold-repeats 3]

Prints two tables, then one JSON line:
{"bench": "adapter_cost", "group": 8, "ms_per_group": {arm: {"native", "adapter", "ratio"}},
 "one_time_ms": {...}, "checked": ..., "faults": 0, "agree": true}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(ROOT), str(ROOT / "examples")]  # tests.envs.vf_sums; verifiers_guess, gym_blackjack
sys.path[:0] = [p for p in PATHS if p not in sys.path]
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # verifiers' dataset maps

from echo2p2p import episodes  # noqa: E402
from echo2p2p.episodes import MAX_TURNS, Step  # noqa: E402

G = 8
ARMS = ("trl", "vf single", "vf multi", "gym")
ENVS = {"vf single": "verifiers:tests.envs.vf_sums", "vf multi": "verifiers:verifiers_guess",
        "gym": "gym:gym_blackjack:BlackjackText"}


def sums_row(seed: int) -> dict[str, str]:
    """tests/envs/vf_sums's row of `seed`: its 40 held-out rows (offset 0), then training rows
    (offset 100), as the verifiers adapter numbers them."""
    i = seed if seed < 40 else 100 + seed - 40
    return {"question": f"{10 + i % 80}+{1 + i % 9}=", "answer": str(10 + i % 80 + 1 + i % 9)}


def native_sums(prompt: str, completion: str, row: dict) -> float:
    """vf_sums's rubric in our contract: exact answer 1.0, plus 0.25 for digits only."""
    text = completion.strip()
    return float(text == row["answer"]) + 0.25 * float(text.isdigit())


def trl_sums(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """The same rubric as TRL writes a reward function: a batch in, one float per completion."""
    return [float(c.strip() == a) + 0.25 * float(c.strip().isdigit())
            for c, a in zip(completions, answer)]


class NativeGuess:
    """examples/verifiers_guess.py in our contract: guess 1-3 in two turns; seed i's secret is
    1 + i % 3 (its 64 held-out rows, then its training rows, offset 64: the same cycle)."""

    max_turns = 2

    def reset(self, seed: int) -> str:
        self.secret, self.turns = 1 + seed % 3, 0
        return "guess 1-3:"

    def step(self, action: str) -> Step:
        self.turns += 1
        text = action.strip()
        guess = int(text) if text.isdigit() and 1 <= int(text) <= 3 else None
        if guess == self.secret:
            return Step("", 1.0, True)
        if guess is None or self.turns >= self.max_turns:
            return Step("", 0.0, True)
        return Step("higher:" if guess < self.secret else "lower:", 0.0, False)


class NativeBlackjack:
    """examples/gym_blackjack.py in our contract, driving gymnasium's Blackjack-v1 directly:
    "1" hits, "2" sticks, anything else forfeits (-2)."""

    max_turns = MAX_TURNS

    def __init__(self):
        import gymnasium

        self.game = gymnasium.make("Blackjack-v1")

    def reset(self, seed: int) -> str:
        state, _info = self.game.reset(seed=seed)
        return f"{state[0]} v {state[1]}:"

    def step(self, action: str) -> Step:
        move = {"1": 1, "2": 0}.get(action.strip())
        if move is None:
            return Step("", -2.0, True)
        state, reward, terminated, truncated, _info = self.game.step(move)
        done = bool(terminated or truncated)
        return Step("" if done else f"{state[0]} v {state[1]}:", float(reward), done)


def act(arm: str, seed: int, turn: int) -> str:
    """The scripted model's turn `turn` of episode `seed`: mostly legal, some not."""
    rng = random.Random(f"{arm}:{seed}:{turn}")
    if arm in ("trl", "vf single"):
        answer = sums_row(seed)["answer"]
        return rng.choice([answer, answer, answer, str(int(answer) + 1), "12a", "abc", ""])
    if arm == "vf multi":
        return rng.choice(["1", "2", "3", "1", "2", "3", "7", "x", ""])
    return rng.choice(["1", "2", "1", "2", "1", "2", "1", "2", "3", "hit", ""])


def play(arm: str, factory: Any, seeds: list[int], decoder: Any) -> list[episodes.Played]:
    """Episodes of `seeds` played with `act`'s turns. The prompt ids are "SEED:" only, the
    script's key (a replay never reads the prompt); a turn is its text's ids and EOS."""
    colon = decoder.encode(":")[0]

    def turns(contexts: list[list[int]]) -> list[episodes.Turn]:
        out = []
        for context in contexts:
            seed = int(decoder.turn_text(context[:context.index(colon)]))
            text = act(arm, seed, context.count(decoder.eos_id))
            ids = decoder.encode(text) + [decoder.eos_id]
            assert decoder.turn_text(ids) == text, f"{text!r} does not round-trip"
            out.append((ids, [-1.0] * len(ids), text, True))
        return out

    prompts = [decoder.encode(f"{s}:") for s in seeds]
    return episodes.play([factory() for _ in seeds], seeds, prompts, turns, encode=decoder.encode)


@dataclass
class Arm:
    """One task twice: the reward each side is scored with, and its items in groups of G."""

    name: str
    native: Any
    adapter: Any
    native_items: list[list[tuple]]
    adapter_items: list[list[tuple]]
    played: list[float]  # each sample's reward as it was played


def build(name: str, groups: int, decoder: Any) -> Arm:
    """Arm `name` over `groups` groups: its episodes played, its items as the wire has them."""
    from echo2p2p.messages import pack_ids
    from echo2p2p.adapters.environments import find_environment
    from echo2p2p.scoring.rewards import EpisodeReplay, RewardFunctions
    from echo2p2p.tasks.base import Problem

    def texts(ids: list[list[int]]) -> list[tuple]:  # vf_sums's rows, scored as texts
        rows = [sums_row(s) for s in seeds]
        return [(Problem(f"sums-{s}", f"Add.\n{r['question']}", r["answer"], r), pack_ids(i),
                 decoder.turn_text(i)) for s, r, i in zip(seeds, rows, ids)]

    seeds = list(range(groups * G))
    native = RewardFunctions([native_sums])
    if name == "trl":
        items = texts([decoder.encode(act(name, s, 0)) + [decoder.eos_id] for s in seeds])
        rewards = [native_sums("", text, problem.row) for problem, _, text in items]
        return Arm(name, native, RewardFunctions([trl_sums]), _groups(items), _groups(items),
                   rewards)
    factory = find_environment(ENVS[name]).factory
    played = play(name, factory, seeds, decoder)
    replays = [(Problem(f"{name}-{s}", "", str(s), {"seed": s}), pack_ids(p.ids), p.action,
                episodes.pack_turns(p.turns)) for s, p in zip(seeds, played)]
    if name == "vf single":
        natives = texts([p.ids for p in played])
    else:
        native, natives = EpisodeReplay({"vf multi": NativeGuess, "gym": NativeBlackjack}[name]), replays
    return Arm(name, native, EpisodeReplay(factory), _groups(natives), _groups(replays),
               [p.reward for p in played])


def _groups(items: list[tuple]) -> list[list[tuple]]:
    return [items[i:i + G] for i in range(0, len(items), G)]


def check(arm: Arm, decoder: Any) -> dict[str, Any]:
    """Score every item once each way: the faults (any note but OK), and whether native,
    adapter and the play agree sample by sample."""
    from echo2p2p.scoring.worker import OK, score_item

    flat = lambda groups: [i for g in groups for i in g]  # noqa: E731
    native = [score_item(arm.native, decoder, i) for i in flat(arm.native_items)]
    adapter = [score_item(arm.adapter, decoder, i) for i in flat(arm.adapter_items)]
    faults = [f"{side}: {note} {detail}" for side, verdicts in (("native", native),
              ("adapter", adapter)) for _, note, detail in verdicts if note != OK]
    agree = ([r for r, _, _ in native] == [r for r, _, _ in adapter] == arm.played)
    return {"samples": len(native), "faults": faults, "agree": agree,
            "rewards": sorted(set(arm.played))}


def time_arms(arms: list[Arm], groups: int, rounds: int, decoder: Any) -> dict[str, dict]:
    """ms per group of each side of each arm: `rounds` rounds, each timing groups/rounds
    groups of every arm and side, interleaved, the side that goes first alternating."""
    from echo2p2p.scoring.worker import score_item

    per_round = max(1, -(-groups // rounds))
    ms: dict[str, dict[str, list[float]]] = {a.name: {"native": [], "adapter": []} for a in arms}
    for r in range(rounds):
        for arm in arms:
            sides = [("native", arm.native, arm.native_items),
                     ("adapter", arm.adapter, arm.adapter_items)]
            for side, reward, pool in sides[::1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                for k in range(per_round):
                    for item in pool[(r * per_round + k) % len(pool)]:
                        score_item(reward, decoder, item)
                ms[arm.name][side].append((time.perf_counter() - start) * 1e3 / per_round)
    out = {}
    for name, sides in ms.items():
        ratios = [a / n for a, n in zip(sides["adapter"], sides["native"])]
        out[name] = {"native": round(statistics.median(sides["native"]), 3),
                     "adapter": round(statistics.median(sides["adapter"]), 3),
                     "ratio": round(statistics.median(ratios), 2),
                     "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)]}
    return out


COLD = {  # what a fresh process runs for each adapter, in order: (label, code); None: untimed
    "trl": [("import", "import echo2p2p.adapters.trl_rewards"),
            (None, "from echo2p2p.scoring.rewards import RewardFunctions"),
            ("load", "RewardFunctions([trl_sums])"),
            ("load native", "RewardFunctions([native_sums])")],
    "verifiers": [("import", "import echo2p2p.adapters.verifiers_env"),
                  ("load vf single", "s = find_environment(ENVS['vf single'])"),
                  ("check vf single", "assert not episodes.undetermined(s.factory, range(8))"),
                  ("load vf multi", "m = find_environment(ENVS['vf multi'])"),
                  ("check vf multi", "assert not episodes.undetermined(m.factory, range(8))")],
    "gymnasium": [("import gymnasium", "import gymnasium"),
                  ("import", "import echo2p2p.adapters.gym_env"),
                  ("load gym", "g = find_environment(ENVS['gym'])"),
                  ("check gym", "assert not episodes.undetermined(g.factory, range(8))")],
    "native": [("check vf multi", "assert not episodes.undetermined(NativeGuess, range(8))"),
               ("import gymnasium", "import gymnasium"),
               ("check gym", "assert not episodes.undetermined(NativeBlackjack, range(8))")],
}


def cold(library: str) -> dict[str, float]:
    """ms of each step of `COLD[library]`, run here in order (in a fresh process)."""
    from echo2p2p.adapters.environments import find_environment  # imports no adapter

    scope = dict(globals(), find_environment=find_environment)
    out = {}
    for label, code in COLD[library]:
        start = time.perf_counter()
        exec(code, scope)
        if label:
            out[label] = round((time.perf_counter() - start) * 1e3, 1)
    return out


def one_time(repeats: int) -> dict[str, dict[str, float]]:
    """The median over `repeats` fresh processes of each library's one-time costs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(PATHS + [os.environ.get("PYTHONPATH", "")]))
    out = {}
    for library in COLD:
        runs = []
        for _ in range(repeats):
            done = subprocess.run([sys.executable, __file__, "--cold", library], env=env,
                                  capture_output=True, text=True, check=True, timeout=300)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        out[library] = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
    return out


def measure(groups: int, rounds: int, pool: int, cold_repeats: int) -> dict[str, Any]:
    """The bench's result (what the JSON line says)."""
    from echo2p2p.completions import CompletionDecoder
    from echo2p2p.policy.model import load_policy

    _model, tokenizer = load_policy("tiny-takeaway", weights=False)
    decoder = CompletionDecoder(tokenizer)
    arms = [build(name, pool, decoder) for name in ARMS]
    checks = {a.name: check(a, decoder) for a in arms}
    timed = time_arms(arms, groups, rounds, decoder)
    return {"bench": "adapter_cost", "group": G, "groups": max(1, -(-groups // rounds)) * rounds,
            "rounds": rounds, "pool_groups": pool, "ms_per_group": timed,
            "one_time_ms": one_time(cold_repeats) if cold_repeats else {},
            "checked": {n: {k: c[k] for k in ("samples", "agree", "rewards")}
                        for n, c in checks.items()},
            "faults": sum(len(c["faults"]) for c in checks.values()),
            "fault_samples": [f for c in checks.values() for f in c["faults"]][:5],
            "agree": all(c["agree"] for c in checks.values())}


def show(result: dict[str, Any]) -> None:
    print(f"scoring cost per group (G = {result['group']}), median of {result['rounds']} "
          f"interleaved rounds, {result['groups']} groups per side")
    print(f"{'arm':<11}{'native ms':>11}{'adapter ms':>12}{'ratio':>8}{'  ratio range':<16}")
    for name, t in result["ms_per_group"].items():
        lo, hi = t["ratio_range"]
        print(f"{name:<11}{t['native']:>11.3f}{t['adapter']:>12.3f}{t['ratio']:>8.2f}"
              f"  {lo:.2f}-{hi:.2f}")
    if result["one_time_ms"]:
        print("one-time ms (fresh process, median): import (library included), load "
              "(find_environment), check (undetermined, 8 seeds)")
        for library, steps in result["one_time_ms"].items():
            print(f"  {library:<10}" + "  ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    print(f"checked: faults {result['faults']}, native = adapter = played: {result['agree']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=960, help="groups timed per arm and side")
    p.add_argument("--rounds", type=int, default=24, help="interleaved rounds (medians over them)")
    p.add_argument("--pool", type=int, default=16, help="distinct groups played per arm")
    p.add_argument("--cold-repeats", type=int, default=3,
                   help="fresh processes per library for the one-time costs (0: skip them)")
    p.add_argument("--cold", choices=sorted(COLD), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cold:
        print(json.dumps(cold(args.cold)))
        return {}
    result = measure(args.groups, args.rounds, args.pool, args.cold_repeats)
    show(result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
