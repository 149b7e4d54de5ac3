"""The code task's reward: a completion's program run against its row's tests in the sandbox.

`code_tests(prompt, completion, row)` builds a program from the completion, runs it in the
sandbox (`echo2p2p.scoring.sandbox`), runs the row's tests against it, and scores those passed.
Row fields (JSON values):
- "tests": Python source, one string (reward 1.0 if it runs without raising, else 0.0) or a list
  of them (reward: the fraction that run without raising; each runs even if one before failed);
- "program" (optional, default "{code}"): the program's template. "{prompt}", "{completion}" and
  "{code}" in it stand for the prompt, the completion, and the completion's code: its first
  fenced block (```python ... ```, closed or not) if it has one, else the whole completion.
  "{prompt}{completion}" says the completion continues the prompt; "x = {completion}" makes it
  an expression;
- "timeout_s", "memory_bytes", "file_bytes" (optional): the sandbox's limits (2 s, 256 MiB and
  1 MiB by default; the program's time includes answering the tests). The scorer's deadline
  must leave room for timeout_s and ~0.1 s of start-up.
The program runs in the sandbox, as a process of its own; the tests never do. They run here,
in the scorer's worker (they are the row's, the operator's code, as reward functions are), in a
namespace holding the program's names: its functions as `Remote`s that call it over a pipe
with plain arguments, its other globals as plain values (`CODEC`: None, bools, numbers, str,
bytes, and lists, tuples, sets and dicts of them). Nothing of the verdict comes from the
program's process, so no line it prints and no status it exits with can pass a test; and a
test compares plain values, so an object whose `__eq__` always says True is not one.
A program that tries to forge a verdict anyway is told apart: its harness holds a decoy token
(printing it is reading the harness to forge its line), and a program that ends its process
with status 0 while the tests are still asking it is exiting "successfully" instead of
answering. Either raises `ForgedPass`, which the hub scores 0 and counts against the peer.
What it does not stop: a program that answers the tests' calls right without being what the
task asked (a lookup table of the tests' inputs, say). Tests that need the program's own
objects (instances of its classes, callbacks) cannot see them: give them plain values.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
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
log = logging.getLogger(__name__)

# Plain values as JSON, both ways: None, bool, int, float and str as themselves; list, tuple,
# set, frozenset, dict and bytes tagged ({"tuple": [...]}, {"dict": [[k, v], ...]}). Exec'd
# here and pasted into the program's harness: one codec for both sides.
CODEC = """\
def _plain(v, depth=0):
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if depth > 32:
        raise ValueError("nested too deep")
    if t in (list, tuple, set, frozenset):
        return {t.__name__: [_plain(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[_plain(k, depth + 1), _plain(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    raise TypeError(f"a {t.__name__} is no plain value")


def _value(v, depth=0):
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is not dict or len(v) != 1 or depth > 32:
        raise ValueError("not a plain value")
    (tag, x), = v.items()
    if tag == "bytes" and type(x) is str:
        return bytes.fromhex(x)
    if type(x) is not list:
        raise ValueError("not a plain value")
    if tag == "dict":
        return {_value(k, depth + 1): _value(y, depth + 1) for k, y in x}
    kinds = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
    if tag not in kinds:
        raise ValueError("not a plain value")
    return kinds[tag](_value(y, depth + 1) for y in x)
"""

# The program's side: run the program, then answer the judge's questions on the pipes
# (`main.py IN OUT`): "names" (its globals: callables, and values as plain data) and "call"
# (a function of it on plain arguments: its plain result or the exception's type and text).
# The decoy is never read back: no verdict comes from this process (module docstring).
SERVE = """\
import json, os, sys
_decoy = {decoy!r}
_program = {program!r}
{codec}
_in, _out = os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb")
_scope = {{"__name__": "__main__"}}
try:
    exec(compile(_program, "<program>", "exec"), _scope)
except BaseException as _e:
    print(f"the program failed: {{type(_e).__name__}}: {{_e}}"[:300], file=sys.stderr)
    _scope = None


def _answer(ask):
    if _scope is None:
        return ["failed"]
    if ask[0] == "names":
        names = {{}}
        for name, v in list(_scope.items())[:1000]:
            if callable(v):
                names[name] = ["call"]
            else:
                try:
                    names[name] = ["value", _plain(v)]
                except (TypeError, ValueError):
                    pass
        return names
    try:
        return ["ok", _plain(_scope[ask[1]](*_value(ask[2]), **_value(ask[3])))]
    except (Exception, SystemExit) as e:  # sys.exit() in a function: a failed call, no forgery
        return ["raise", type(e).__name__, str(e)[:300]]


for _line in _in:
    _out.write(json.dumps(_answer(json.loads(_line))).encode() + b"\\n")
    _out.flush()
"""
_codec: dict[str, Any] = {}
exec(CODEC, _codec)  # noqa: S102 -- our own source, above
plain, value = _codec["_plain"], _codec["_value"]
ANSWER_BYTES = 2**20  # the most one answer of the program may hold


class ForgedPass(Exception):
    """A completion's program tried to forge the harness's verdict: it printed the decoy token
    or ended its process with status 0 while the tests were asking it. Raised by `code_tests`
    (a reward returns a float: this is its one way to say more); the scoring worker scores the
    sample 0 and notes it, and the hub counts it against the peer's trust."""


class ProgramGone(Exception):
    """The program did not answer (it ended, broke the protocol or ran out of time)."""


class Remote:
    """A function of the program, called from a test: plain arguments there, a plain result (or
    the exception it raised, as a builtin exception of that name if one exists) back."""

    def __init__(self, judge: Judge, name: str):
        self.judge, self.name = judge, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # the program's function: open
        answer = self.judge.ask(["call", self.name, plain(args), plain(kwargs)])
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == "ok":
            return value(answer[1])
        if isinstance(answer, list) and len(answer) == 3 and answer[0] == "raise":
            cls = getattr(builtins, str(answer[1]), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(str(answer[2]))
            raise RuntimeError(f"{answer[1]}: {answer[2]}")
        raise ProgramGone(f"{self.name}: no answer")


class Judge:
    """The tests' side of one run: asks the program over the sandbox's channel."""

    def __init__(self, tests: Sequence[str]):
        self.tests, self.passed = list(tests), set()
        self.channel: sandbox.Channel | None = None

    @property
    def hung_up(self) -> bool:
        """The program closed its end while the tests were asking it."""
        return self.channel is not None and self.channel.hung_up

    def ask(self, question: list) -> Any:  # a JSON answer
        line = self.channel.ask(json.dumps(question).encode(), ANSWER_BYTES)
        try:
            return json.loads(line) if line is not None else None
        except (ValueError, RecursionError):
            return None

    def __call__(self, channel: sandbox.Channel) -> None:
        """Run every test against the program's names (`run_python`'s talk)."""
        self.channel = channel
        names = self.ask(["names"])
        if not isinstance(names, dict):
            return
        scope: dict[str, Any] = {"__name__": "__test__"}
        for name, what in names.items():
            if not (isinstance(name, str) and name.isidentifier() and not name.startswith("__")
                    and not hasattr(builtins, name) and isinstance(what, list) and what):
                continue  # a builtin's name: the tests' `sorted` stays Python's
            if what == ["call"]:
                scope[name] = Remote(self, name)
            elif what[0] == "value" and len(what) == 2:
                with contextlib.suppress(ValueError, TypeError, RecursionError):
                    scope[name] = value(what[1])
        for i, test in enumerate(self.tests):
            try:
                exec(compile(test, f"<test {i}>", "exec"), scope)  # noqa: S102 -- the row's
            except Exception as exc:
                log.debug("test %d failed: %s: %s", i, type(exc).__name__, exc)
            else:
                self.passed.add(i)


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


# `limits`: `Limits`' fields, passed through.
def run_tests(program: str, tests: Sequence[str], **limits: Any) -> set[int]:
    """The indices of `tests` that passed against `program`, run in the sandbox (module
    docstring); ForgedPass if the program tried to forge the verdict."""
    decoy = os.urandom(16).hex()
    judge = Judge(tests)
    result = sandbox.run_python(SERVE.format(decoy=decoy, program=program, codec=CODEC),
                                talk=judge, **limits)
    if decoy in result.stdout_tail or decoy in result.stderr_tail:
        raise ForgedPass("the program printed the harness's decoy token")
    if judge.hung_up and result.exit_code == 0:
        raise ForgedPass("the program ended its process with status 0 before the tests did")
    return judge.passed
