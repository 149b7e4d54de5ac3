"""`echo2-hub`: serve a training run, run the whole demo (hub + local peers) in one command, or
plan the rollout capacity and the workers to rent for a run.

Heavy imports (torch, transformers) happen after argument parsing, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tomllib
from pathlib import Path

from echo2p2p.config import add_arguments, resolve
from echo2p2p.errors import ConfigError

from echo2p2p.runtime import process

from .config import HubConfig, help_texts
from .plan import PlanConfig

log = logging.getLogger(__name__)

DEMO_DEFAULTS = {"port": 0, "max_steps": 150, "torch_threads": 1, "eval_every": 10}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo2-hub", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="train, serving rollout peers over websockets")
    demo = sub.add_parser("demo", help="hub + N local peer processes on the built-in model and task")
    demo.add_argument("--peers", type=int, default=2, help="local peer processes to start (default: 2)")
    demo.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                      help="the local peers' rollout engine (default: transformers); vllm runs "
                           "them under the vLLM environment's Python (see --peer-python)")
    demo.add_argument("--peer-python", metavar="PATH", default="",
                      help="the Python the local peers run under (default: this one; with "
                           "--engine vllm: $ECHO2_VLLM_PYTHON, else .venv-vllm/bin/python as "
                           "made by .ci/vllm-env, else this one if it has vLLM)")
    serve.add_argument("--resume", type=Path, metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its last checkpoint, with its saved "
                            "config (flags given here override it)")
    for p in (serve, demo):
        p.add_argument("--config", type=Path, help="TOML file setting any of the fields below")
        p.add_argument("--log-level", default="info", help="debug, info, warning (default: info)")
        add_arguments(p, HubConfig, docs=help_texts(HubConfig))
    demo.epilog = "demo defaults differ from serve: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in DEMO_DEFAULTS.items())
    plan = sub.add_parser("plan", help="offline: required rollout throughput, feasible S/kappa, "
                                       "which workers to activate and what it costs")
    plan.add_argument("--config", type=Path, help="TOML file setting any of the fields below")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_arguments(plan, PlanConfig, docs=help_texts(PlanConfig))
    token = sub.add_parser("token", help="join tokens: create, list or revoke (serve --tokens FILE)")
    token.add_argument("action", choices=("create", "list", "revoke"))
    token.add_argument("token_id", nargs="?", help="for revoke: the id `list` shows")
    token.add_argument("--file", type=Path, default=Path("tokens.json"),
                       help="the token file (default: tokens.json)")
    token.add_argument("--name", default="", help="for create: who the token is for")
    return parser


def load_config(args: argparse.Namespace, defaults: dict | None = None) -> HubConfig:
    table = dict(defaults or {})
    if getattr(args, "resume", None) is not None:
        saved = json.loads((args.resume / "config.json").read_text())
        saved.pop("run_id", None)
        table.update(saved, run_dir=str(args.resume))
    if args.config is not None:
        data = tomllib.loads(args.config.read_text())
        table.update(data.get("hub", data))
    return resolve(HubConfig, table, vars(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        return _plan(args)
    if args.command == "token":
        return _token(args)
    process.configure(args.log_level)
    try:
        cfg = load_config(args, DEMO_DEFAULTS if args.command == "demo" else None)
    except (ConfigError, tomllib.TOMLDecodeError, OSError, ValueError) as exc:
        print(f"echo2-hub: {exc}", file=sys.stderr)
        return 2
    if args.command == "demo" and args.peers < 1:
        print("echo2-hub: --peers must be >= 1", file=sys.stderr)
        return 2
    from .demo import peer_python, run_demo, run_serve

    if args.command == "demo":
        try:
            python = peer_python(args.engine, args.peer_python)
        except ConfigError as exc:
            print(f"echo2-hub: {exc}", file=sys.stderr)
            return 2
        coro = run_demo(cfg, args.peers, engine=args.engine, python=python)
    else:
        coro = run_serve(cfg, args.resume)
    try:
        return process.run(coro)
    except KeyboardInterrupt:
        return 130
    except (ConfigError, FileNotFoundError) as exc:  # found on start: a bad TLS pair, no checkpoint
        print(f"echo2-hub: {exc}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    from .plan import run

    try:
        table = tomllib.loads(args.config.read_text()).get("plan", {}) if args.config else {}
        print(run(resolve(PlanConfig, table, vars(args)), args.json))
    except (ConfigError, tomllib.TOMLDecodeError, OSError) as exc:
        print(f"echo2-hub plan: {exc}", file=sys.stderr)
        return 2
    return 0


def _token(args: argparse.Namespace) -> int:
    from .tokens import TokenBook

    book = TokenBook(args.file)
    try:
        if args.action == "create":
            print(book.create(args.name))
            print(f"(shown once; the hub keeps only its hash, in {args.file})", file=sys.stderr)
        elif args.action == "list":
            for e in book.entries():
                state = "revoked" if e["revoked"] is not None else "active"
                print(f"{e['id']}  {state:7s}  {e['name']}")
        elif not args.token_id:
            print("echo2-hub token revoke: which token id? (see `echo2-hub token list`)",
                  file=sys.stderr)
            return 2
        elif not book.revoke(args.token_id):
            print(f"echo2-hub token revoke: no token {args.token_id!r} in {args.file}",
                  file=sys.stderr)
            return 2
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"echo2-hub token: cannot use {args.file}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
