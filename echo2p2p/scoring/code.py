"""The code task's reward: a completion's program run against its row's tests in the sandbox.

`code_tests(prompt, completion, row)` builds a program from the completion, runs it and then the
row's tests in one sandboxed process (`echo2p2p.scoring.sandbox`), and scores the tests passed.
Row fields (JSON values):
- "tests": Python source, one string (reward 1.0 if it runs without raising, else 0.0) or a list
  of them (reward: the fraction that run without raising; each runs even if one before failed);
- "program" (optional, default "{code}"): the program's template. "{prompt}", "{completion}" and
  "{code}" in it stand for the prompt, the completion, and the completion's code: its first
  fenced block (```python ... ```, closed or not) if it has one, else the whole completion.
  "{prompt}{completion}" says the completion continues the prompt; "x = {completion}" makes it
  an expression;
- "timeout_s", "memory_bytes", "file_bytes" (optional): the sandbox's limits (2 s, 256 MiB and
  1 MiB by default). The scorer's deadline must leave room for timeout_s and ~0.1 s of start-up.
The program and then each test are exec'd in one namespace (the tests see the program's names);
the harness then prints a random token and the indices of the tests that passed, as its last
line. Nothing counts without that line and an exit status of 0, so a program that ends the
process early (`sys.exit()`, `os._exit(0)`) or breaks its output passes no test.
What it does not stop: a program that reads its own source or stack frames can find the token
and forge the line; and the tests trust the program's objects (an `__eq__` that always says
True passes `assert f() == 3`). A policy that learns such tricks needs tests written against them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from . import sandbox

DEFAULTS = {"timeout_s": sandbox.DEFAULT_TIMEOUT_S, "memory_bytes": sandbox.DEFAULT_MEMORY_BYTES,
            "file_bytes": sandbox.DEFAULT_FILE_BYTES}
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
FIELD = re.compile(r"\{(prompt|completion|code)\}")

HARNESS = '''\
import sys
_token, _program, _tests = {token!r}, {program!r}, {tests!r}
_scope = {{"__name__": "__main__"}}
exec(compile(_program, "<program>", "exec"), _scope)
_passed = []
for _i, _test in enumerate(_tests):
    try:
        exec(compile(_test, f"<test {{_i}}>", "exec"), _scope)
    except Exception as _e:
        print(f"test {{_i}} failed: {{type(_e).__name__}}: {{_e}}"[:300], file=sys.stderr)
    else:
        _passed.append(_i)
print("\\n" + _token, *_passed, flush=True)  # on a line of its own
'''


def code_tests(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """The fraction of the row's tests the completion's program passes (module docstring)."""
    tests = row.get("tests")
    listed = isinstance(tests, (list, tuple))
    tests = list(tests) if listed else [tests]
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("a code row needs 'tests': a string or a non-empty list of strings")
    passed = run_tests(program_of(prompt, completion, row), tests, **limits_of(row))
    if listed:
        return len(passed) / len(tests)
    return 1.0 if passed else 0.0


def program_of(prompt: str, completion: str, row: Mapping[str, Any]) -> str:
    """The program `row["program"]` makes of this prompt and completion (module docstring)."""
    fenced = FENCE.search(completion)
    values = {"prompt": prompt, "completion": completion,
              "code": fenced.group(1) if fenced else completion}
    return FIELD.sub(lambda m: values[m.group(1)], str(row.get("program", "{code}")))


def limits_of(row: Mapping[str, Any]) -> dict[str, float]:
    """The sandbox limits a row asks for, else the defaults; ValueError on a bad one."""
    limits = {name: row.get(name, default) for name, default in DEFAULTS.items()}
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"a code row's {name!r} must be a positive number, got {value!r}")
    limits["memory_bytes"], limits["file_bytes"] = (int(limits["memory_bytes"]),
                                                    int(limits["file_bytes"]))
    return limits


def run_tests(program: str, tests: Sequence[str], **limits: Any) -> set[int]:
    """The indices of `tests` that ran without raising after `program`, in one sandboxed run;
    none unless the run exited 0 with the harness's token line last."""
    token = os.urandom(16).hex()
    result = sandbox.run_python(HARNESS.format(token=token, program=program, tests=list(tests)),
                                **limits)
    lines = result.stdout_tail.splitlines()
    if not result.passed or not lines or lines[-1].split(" ")[0] != token:
        return set()
    return {int(i) for i in lines[-1].split()[1:] if i.isdigit() and int(i) < len(tests)}
