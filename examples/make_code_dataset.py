"""Write examples/code.jsonl: a code task the built-in tiny model can learn on a CPU in minutes.

    python examples/make_code_dataset.py            # rewrites examples/code.jsonl
    python examples/make_code_dataset.py --check 200  # the tiny base's rewards on 200 of its rows
    echo2-hub demo --dataset-rows examples/code.jsonl --reward code_tests

The tiny model only knows sums ("47+38=" -> "85", often with junk after it: "85?"), so each row's
prompt is a sum as it knows them, and the completion must be Python: the program is a function
`answer()` whose body is `return <completion>`, and the tests assert on `answer()`, run in the
sandbox by the `code_tests` reward (`echo2p2p.scoring.code`). "85" passes, so does the expression
"47+38"; "85?" is a syntax error and passes nothing. The reward is the fraction of three tests
passed: the last digit, the last two digits, the whole value. Half the rows are sums of two
numbers below 100 (the base passes about 45 % whole and learns to stop cleanly: ~90 % after 80
GRPO steps); the other half add a two-digit number to a three-digit one, which the base never
gets whole (it drops the hundreds: "332+83=" -> "115") and does not learn to in a demo's length,
but its partial credit rises (0.13 -> 0.36 in 80 steps), so the mean reward keeps room to grow.
Rows: "id", "prompt", "program", "tests", and "answer" (the value as text, for an exact-match
reward or an eye). Deterministic: the same file on every run.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROGRAM = "def answer():\n    return {completion}\n"
OUT = Path(__file__).resolve().parent / "code.jsonl"


def problems(rows: int, seed: int = 0) -> list[tuple[str, int]]:
    """`rows` distinct (prompt, value) sums: two-digit ones and three-digit-plus-two-digit ones,
    alternately."""
    rng = random.Random(f"code/{seed}")
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    while len(out) < rows:
        if len(out) % 2 == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
        else:
            a, b = rng.randint(100, 999), rng.randint(10, 99)
        prompt = f"{a}+{b}="
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, a + b))
    return out


def row(index: int, prompt: str, value: int) -> dict:
    """One dataset row: the completion is the body of `answer()`; three tests on its value."""
    return {"id": f"code-{index:05d}", "prompt": prompt, "program": PROGRAM,
            "tests": [f"assert answer() % 10 == {value % 10}",
                      f"assert answer() % 100 == {value % 100}",
                      f"assert answer() == {value}"],
            "answer": str(value)}


def check(path: Path, prompts: int, group_size: int = 8) -> dict:
    """Sample `group_size` completions of the first `prompts` rows of `path` from the tiny base
    as a peer would (temperature 1, 8 new tokens) and score them with `code_tests`; prints and
    returns the mean reward, the share passing every test, the share of groups with unequal
    rewards (the ones GRPO learns from), overall and per half."""
    from echo2p2p.policy.engines import TransformersEngine
    from echo2p2p.policy.prompts import PromptFormat
    from echo2p2p.scoring.code import code_tests

    engine = TransformersEngine("tiny")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()][:prompts]
    kinds: dict[str, list[list[float]]] = {"two-digit": [], "three-digit": []}
    for i, r in enumerate(rows):
        ids = PromptFormat().encode(engine.tokenizer, r["prompt"])
        done = engine.generate(ids, group_size, temperature=1.0, top_p=1.0, max_new_tokens=8,
                               seed=i)
        kind = "three-digit" if len(r["prompt"].split("+")[0]) == 3 else "two-digit"
        kinds[kind].append([code_tests(r["prompt"], c.text, r) for c in done])
    report = {}
    for kind, groups in {**kinds, "all": kinds["two-digit"] + kinds["three-digit"]}.items():
        flat = [x for g in groups for x in g]
        report[kind] = {"groups": len(groups), "reward_mean": round(sum(flat) / len(flat), 3),
                        "all_tests_passed": round(sum(x == 1.0 for x in flat) / len(flat), 3),
                        "groups_with_signal": round(sum(len(set(g)) > 1 for g in groups)
                                                    / len(groups), 3)}
        print(f"{kind:>11}: {report[kind]}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=3000, help="rows to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the sums drawn")
    p.add_argument("--out", type=Path, default=OUT, help="the JSONL file to write")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="write nothing: score the tiny base on the first N rows of --out")
    args = p.parse_args(argv)
    if args.check:
        check(args.out, args.check)
        return 0
    lines = [json.dumps(row(i, prompt, value))
             for i, (prompt, value) in enumerate(problems(args.rows, args.seed))]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
