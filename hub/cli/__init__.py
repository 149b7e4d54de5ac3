"""`echo2-hub`: serve a training run, run the whole demo (hub + local peers) in one command, or
plan the rollout capacity and the workers to rent for a run.

Heavy imports (torch, transformers) happen after argument parsing, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from echo2p2p.config import add_arguments, owners, parse_args, resolve
from echo2p2p.errors import ConfigError

from echo2p2p.runtime import process

from ..config import DEMO_DEFAULTS, HubConfig, help_texts, read_toml
from ..config_presets import flatten, sources_table
from .plan import PlanConfig

log = logging.getLogger(__name__)



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo2-hub", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    docs = help_texts(HubConfig)
    short = "%(prog)s [options]"  # the full list of flags is --help's (over 60 lines)
    serve = sub.add_parser("serve", usage=short,
                           help="train, serving rollout peers over websockets")
    demo = sub.add_parser("demo", usage=short,
                          help="hub + N local peer processes on the built-in model and task")
    demo.add_argument("--peers", type=int, default=2, help="local peer processes to start (default: 2)")
    demo.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                      help="the local peers' rollout engine (default: transformers); vllm runs "
                           "them under the vLLM environment's Python (see --peer-python)")
    demo.add_argument("--peer-python", metavar="PATH", default="",
                      help="the Python the local peers run under (default: this one; with "
                           "--engine vllm: $ECHO2_VLLM_PYTHON, else .venv-vllm/bin/python as "
                           "made by .ci/vllm-env, else this one if it has vLLM)")
    for p in (serve, demo):
        p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                       help="continue the run in RUN_DIR from its last checkpoint, with its saved "
                            "config (flags given here override it); Ctrl-C checkpoints and prints "
                            "this command")
        p.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                       help="shard the learner over N local ranks: re-run this command under "
                            "torchrun (python -m torch.distributed.run --nproc-per-node N); for "
                            "several nodes run torchrun yourself on each "
                            "(docs/guides/multi-gpu.md)")
        p.add_argument("--config", type=Path, help="TOML file setting any of the fields below, "
                                                   "in a [hub] table (or its [hub.SECTION] tables)")
        p.add_argument("--log-level", default="info", help="debug, info, warning (default: info)")
        p.add_argument("--print-config", action="store_true",
                       help="print the config as the hub will use it, each field with where "
                            "its value came from (flag, file, the model's preset, derived from "
                            "its size, fitted to the model and --max-memory, default), and the "
                            "memory it predicts, and exit without starting")
        add_arguments(p, HubConfig, docs=docs)
    demo.epilog = "demo defaults differ from serve: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in DEMO_DEFAULTS.items())
    plan = sub.add_parser("plan", usage=short, help="offline: required rollout throughput, "
                          "feasible S/kappa, which workers to activate and what it costs")
    plan.add_argument("--config", type=Path, help="TOML file setting any of the fields below")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    add_arguments(plan, PlanConfig, docs=help_texts(PlanConfig))
    token = sub.add_parser("token", help="join tokens: create, list or revoke (serve --tokens FILE)")
    token.add_argument("action", choices=("create", "list", "revoke"))
    token.add_argument("token_id", nargs="?", help="for revoke: the id `list` shows")
    token.add_argument("--file", type=Path, default=Path("tokens.json"),
                       help="the token file (default: tokens.json)")
    token.add_argument("--name", default="", help="for create: who the token is for")
    _add_status_and_report(sub)
    from ..conformance import add_arguments as add_kit_arguments

    add_kit_arguments(sub.add_parser("conformance", help="check a peer implementation against "
                                     "the protocol spec (docs/guides/conformance.md)"))
    for command in (serve, demo, plan, token):  # status and report say their own failures
        command.add_argument("--debug", action="store_true",
                             help="show the traceback of a failure (else one line naming the "
                                  "cause and the fix)")
    return parser


def _add_status_and_report(sub: argparse._SubParsersAction) -> None:
    """`status URL` (a running hub in the terminal) and `report RUN_DIR` (a run's figures)."""
    status = sub.add_parser("status", help="a running hub in the terminal: step, reward, S, "
                                           "busy, cost and its peers (--watch to refresh)")
    status.add_argument("url", help="the hub's http(s)://HOST:PORT (its peers' port or its "
                                    "dashboard's), with or without /status")
    status.add_argument("--token", default=os.environ.get("ECHO2_DASHBOARD_TOKEN", ""),
                        help="the dashboard's access token, which the peers' port needs too "
                             "to show the peers (default: $ECHO2_DASHBOARD_TOKEN)")
    status.add_argument("--ca-cert", default="", metavar="PEM",
                        help="certificate authority to trust for an https hub with a private "
                             "or self-signed certificate")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                        help="redraw every SECONDS (default 2) until Ctrl-C, retrying a hub "
                             "that does not answer")
    status.add_argument("--count", type=int, default=0, metavar="N",
                        help="with --watch: stop after N refreshes (0: never)")
    status.add_argument("--timeout-s", type=float, default=5.0,
                        help="seconds to wait for the hub's answer (default: 5)")
    report = sub.add_parser("report", help="a run's figures as PNGs and one self-contained "
                                           "HTML file (pip install 'echo2p2p[report]')")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="the run directory (its metrics.jsonl and config.json)")
    report.add_argument("--out", type=Path, metavar="DIR",
                        help="where the PNGs and report.html go (default: RUN_DIR/report)")


def given(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields the command line sets, flat (flags over the --config file over the config
    --resume saved), and where each came from: "flag", "file PATH"."""
    table: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def layer(values: dict[str, Any], source: str) -> None:
        flat = flatten(values)
        table.update(flat)
        sources.update(dict.fromkeys(flat, source))

    if getattr(args, "resume", None) is not None:
        from ..api import saved_config

        layer(saved_config(args.resume), f"file {args.resume / 'config.json'}")
    if args.config is not None:
        data = read_toml(args.config)
        layer(data.get("hub", data), f"file {args.config}")
    fields = owners(HubConfig)
    layer({k: v for k, v in vars(args).items() if k in fields and v is not None}, "flag")
    return table, sources


def load_config(args: argparse.Namespace, defaults: dict | None = None) -> HubConfig:
    """The config the command line gives: the model's preset or derived values for the fields
    it does not set, then `defaults`."""
    from ..api import Run

    table, sources = given(args)
    return Run(table, sources=sources).resolved(defaults)[0]


def _tool(args: argparse.Namespace) -> int:
    """The commands that serve no run: `status`, `report` and `conformance`."""
    if args.command == "status":
        from ..view.watch import main as status

        return status(args)
    if args.command == "report":
        from ..view.report import main as report

        return report(args)
    from ..conformance import run as conformance

    return conformance(args)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a failure named in one line (a bad config, a busy port, a missing
    file; the traceback with --debug), 2 a usage error (argparse's), 130 Ctrl-C; a bug of ours
    still ends in its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(build_parser(), argv)
    if args.command == "plan":
        return _plan(args)
    if args.command == "token":
        return _token(args)
    if args.command in ("status", "report", "conformance"):
        return _tool(args)
    if getattr(args, "nproc_per_node", 0) and "WORLD_SIZE" not in os.environ:
        return _under_torchrun(args.nproc_per_node, argv)
    process.configure(args.log_level)
    from ..api import Run

    try:
        table, sources = given(args)
        run = Run(table, sources=sources)
        cfg, sources = run.resolved(DEMO_DEFAULTS if args.command == "demo" else None)
    except (ConfigError, OSError, ValueError) as exc:
        return process.failed("echo2-hub", exc, args.debug)
    if args.print_config:
        return _print_config(args, cfg, sources)
    if args.command == "demo" and args.peers < 1:
        return process.failed("echo2-hub", ConfigError("peers", "must be >= 1"), args.debug)
    from ..learning.ranks import RankFailure

    try:
        if args.command == "demo":
            run.demo(args.peers, engine=args.engine, peer_python=args.peer_python,
                     resume=args.resume)
        else:
            run.serve(resume=args.resume)
        return 0
    except KeyboardInterrupt as exc:  # Stopped: a clean stop, which said how to resume
        if not hasattr(exc, "signum"):  # before the run's own handlers were set: starting
            print("echo2-hub: stopped by SIGINT while starting: nothing was trained",
                  file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except (ConfigError, FileNotFoundError) as exc:  # found on start: a busy port, no checkpoint
        return process.failed("echo2-hub", exc, args.debug)
    except (RankFailure, BaseExceptionGroup) as exc:  # the learner loop's task group wraps it
        failure = exc if isinstance(exc, RankFailure) else _leaf(exc, RankFailure)
        if failure is None:
            raise
        print(f"echo2-hub: {str(failure).replace('RUN_DIR', cfg.run.run_dir or 'RUN_DIR')}",
              file=sys.stderr)
        return 1


def _print_config(args: argparse.Namespace, cfg: HubConfig, sources: dict[str, str]) -> int:
    """The config as the hub will run it, fitted to the model and the memory budget (each
    fitted field's source says why), and the footprint it predicts; starts nothing."""
    from ..learning.fitting import LocalPeers
    from ..run.start import fitted_sources

    peers = LocalPeers(args.peers, args.engine) if args.command == "demo" else LocalPeers()
    try:
        cfg, sources, lines = fitted_sources(cfg, sources, peers,
                                             resumed=getattr(args, "resume", None) is not None)
    except (ConfigError, OSError, ValueError) as exc:
        return process.failed("echo2-hub", exc, args.debug)
    print(sources_table(cfg, sources, full=True))
    print("\n".join(lines))
    return 0


def _leaf(group: BaseException, kind: type) -> BaseException | None:
    """The first exception of `kind` inside (nested) exception groups."""
    if isinstance(group, kind):
        return group
    for inner in getattr(group, "exceptions", ()):
        if (found := _leaf(inner, kind)) is not None:
            return found
    return None


def _under_torchrun(nproc: int, argv: list[str]) -> int:
    """This command again, with N ranks on this node, under PyTorch's own launcher (its
    rendezvous on a free local port, so two runs on one machine do not collide)."""
    rest, skip = [], False
    for a in argv:
        if skip or a.startswith("--nproc-per-node"):
            skip = a == "--nproc-per-node" and not skip
            continue
        rest.append(a)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",  # a free port
               "--nproc-per-node", str(nproc), "-m", "echo2p2p.hub.cli", *rest]
    return subprocess.run(command).returncode


def _plan(args: argparse.Namespace) -> int:
    from .plan import run

    try:
        table = read_toml(args.config).get("plan", {}) if args.config else {}
        print(run(resolve(PlanConfig, table, vars(args)), args.json))
    except (ConfigError, OSError) as exc:
        return process.failed("echo2-hub", exc, args.debug)
    return 0


def _token(args: argparse.Namespace) -> int:
    from ..serving.tokens import TokenBook

    book = TokenBook(args.file)
    if args.action != "create" and not args.file.is_file():
        return process.failed("echo2-hub", FileNotFoundError(
            f"no token file {args.file}: `echo2-hub token create --file {args.file}` makes "
            f"one, or pass --file with the one `serve --tokens` reads"), args.debug)
    try:
        if args.action == "create":
            print(book.create(args.name))
            print(f"(shown once; the hub keeps only its hash, in {args.file})", file=sys.stderr)
        elif args.action == "list":
            for e in book.entries():
                state = "revoked" if e["revoked"] is not None else "active"
                print(f"{e['id']}  {state:7s}  {e['name']}")
        elif not args.token_id:
            print("echo2-hub: token revoke: which token id? (see `echo2-hub token list`)",
                  file=sys.stderr)
            return 1
        elif not book.revoke(args.token_id):
            print(f"echo2-hub: no token {args.token_id!r} in {args.file} (see `echo2-hub "
                  f"token list --file {args.file}`)", file=sys.stderr)
            return 1
        else:
            print(f"revoked {args.token_id} in {args.file}: a hub serving it refuses the token "
                  f"from now on and sends its peers away at their next heartbeat")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return process.failed("echo2-hub", OSError(f"cannot use {args.file}: {exc}"), args.debug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
