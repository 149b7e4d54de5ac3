"""Real-size weights through the pipeline: a Qwen3-0.6B-shaped model, a real hub and 2 real peers.

The model is built here from Qwen3-0.6B's published config (hidden 1024, MLP 3072, 28 layers,
16 query / 8 KV heads of 128, vocabulary 151936, tied embeddings; 596 M parameters, 1.19 GB in
bf16) with random weights and the built-in character tokenizer padded with filler tokens to
the 151936 ids (a random model samples any of them), saved with `save_pretrained` into
--model-dir (kept for the next run; nothing is downloaded). The hub (`start_hub`, in this
process) trains it with the real learner for --steps steps (G = 2, 2 prompts a step, 4 new
tokens, S = 1, a version every step, lr 1e-5, deltas between anchors; the addition prompts
scored by a coin, `CoinTask`, since random weights solve nothing) while 2 peer processes
(transformers engine in bf16, 1 torch thread each) generate; both join over real websockets and
fetch every version through the overlay. Probes around the hub's own methods time each version:

  publish path  learner step end -> bf16 export -> stream file -> chunks coded -> announce ->
                first and last chunk the hub served; and, single-threaded on the run's own
                weights, bytes/s per core of the bf16 cast, full coding (zstd + blake2b), delta
                coding and hashing, and the signature's time
  reload        per peer, from its transfer report (last chunk in) to its VersionHeld (the
                engine serves the version): staging + `load_weights`; and per engine (--engines:
                transformers in fp32 as `echo2-peer join` builds it; vLLM with .venv-vllm's
                python when it exists) in a process of its own, `load_weights` of a full state
  T_bcast       from the announcement until 90 % of the peers can generate with the version,
                reload included: the hub's propagation record in metrics.jsonl ("t_bcast_s",
                from each peer's VersionHeld after its transfer report)
  memory        peak anonymous RSS (what a process holds; mapped version files are page cache
                and reported apart) of the hub and of each peer, sampled every 0.2 s

Memory of the hub, for P parameters (bytes; bf16 versions, fp32 learner, AdamW):
  RAM  = 16 P_train + 4 (P - P_train)   learner: fp32 weights, + grads and 2 moments if trained
       + 4 P                            the spot-checker's fp32 model (spot_check_fraction > 0)
       + 6 P_largest                    one tensor at a time (fp32 + bf16), while a version is built
  disk = (S + 1) x 2 P                  raw streams: spot-checker and delta base (1 without checks)
       + keep_versions x (full + delta wire bytes)       the chunks the hub serves
Before versions went to disk the "disk" line was RAM as well, plus one more stream (the delta
base was a joined copy): for a 7B model at S = 2, 3 x 14 + 14 + 3 x ~24 GB ~ 128 GB of RAM on
top of the learner's 112 GB. The bench prints the prediction beside the measured peak.
A 2-core, 24 GiB box cannot hold a fully trained 0.6 B learner (9.5 GB) next to two peers, so
--train-layers (default 1) trains the last decoder layers and the final norm only; the
publication, transfer and reload still carry all 596 M parameters (--train-layers 0: all).
Peers hold keep_versions = 2 versions (stream + chunks each), one engine and the staged state.

    python bench/realsize.py [--quick] [--steps 4] [--model-dir ~/.cache/echo2p2p/qwen3-0.6b-shape]

Prints the tables, then one JSON line {"bench": "realsize", ...}. It checks MemAvailable first
and refuses a run that would not fit (--force to run anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import stop  # noqa: E402
from bench.realsize_probes import (  # noqa: E402
    CoinTask, Probes, RssSampler, padded_char_tokenizer, per_core_rates, table)

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)
VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
N_PEERS = 2


def ensure_model(directory: Path, layers: int = 28, seed: int = 0) -> Path:
    """The 0.6B-shaped model saved in `directory` (built once, random weights, bf16 files);
    `layers` < 28 only to smoke-test this bench."""
    from echo2p2p.policy.model import architecture_only

    if (directory / "config.json").exists() and not architecture_only(directory):
        return directory
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = padded_char_tokenizer(QWEN3_0_6B["vocab_size"])
    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": layers},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    assert config.vocab_size >= len(tokenizer)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


async def peer_main(args: argparse.Namespace) -> None:
    """One peer process: the transformers engine in bf16 on 1 thread, joined until killed."""
    import torch

    from echo2p2p.peer.client import PeerClient
    from echo2p2p.peer.config import PeerConfig
    from echo2p2p.policy.engines import TransformersEngine

    torch.set_num_threads(1)
    engine = await asyncio.to_thread(TransformersEngine, args.model_dir, dtype=torch.bfloat16)
    cfg = PeerConfig(hub_url=args.peer, name=args.name, torch_threads=1, listen="127.0.0.1:0",
                     keep_versions=2, leases_in_flight=1, hub_timeout_s=120)
    await PeerClient(cfg, engine=engine).run()


def reload_main(args: argparse.Namespace) -> None:
    """One engine (`--reload KIND`) built as a peer builds it; `load_weights` of the model's own
    full state (bf16, as peers receive it), timed 3 times; one JSON line."""
    import torch
    from safetensors.torch import load_file

    from echo2p2p.policy.engines import make_engine

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    engine = make_engine(args.reload, args.model_dir, "cpu")
    built_s = time.perf_counter() - start
    state = {}
    for f in sorted(Path(args.model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    times = []
    for i in range(3):
        noisy = {k: v + (i + 1) * 1e-3 if v.is_floating_point() else v for k, v in state.items()}
        start = time.perf_counter()
        engine.load_weights(noisy)
        times.append(time.perf_counter() - start)
        del noisy
    out = engine.generate([2, 10, 11, 12], 2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    print(json.dumps({"engine": args.reload, "build_s": round(built_s, 2),
                      "reload_s": [round(t, 3) for t in times], "generated": len(out),
                      "bytes": sum(t.nbytes for t in state.values())}), flush=True)


def hub_config(args: argparse.Namespace, run_dir: Path) -> object:
    from echo2p2p.hub.config import HubConfig

    return HubConfig.from_flat(model=str(args.model_dir), port=0, max_lag=1, publish_every=1,
                     group_size=2, prompts_per_step=2, max_new_tokens=4, max_steps=args.steps,
                     eval_every=0, checkpoint_every=0, lr=1e-5, torch_threads=1,
                     spot_check_fraction=args.spot_fraction, lease_timeout_s=900,
                     peer_timeout_s=300, run_dir=str(run_dir), seed=args.seed)


def freeze(model: object, train_layers: int) -> int:
    """Train the last `train_layers` decoder layers and the final norm (0: everything);
    returns the parameters trained."""
    if train_layers == 0:
        return sum(p.numel() for p in model.parameters())
    n_layers = model.config.num_hidden_layers
    keep = tuple(f"model.layers.{i}." for i in range(n_layers - train_layers, n_layers))
    trained = 0
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(keep) or name.startswith("model.norm."))
        trained += p.numel() if p.requires_grad else 0
    return trained


async def run_cluster(args: argparse.Namespace, run_dir: Path, probes: Probes,
                      rss: RssSampler) -> dict:
    """Hub + N_PEERS peer processes for args.steps steps, until every peer serves the last
    version; the run's facts for the tables."""
    from echo2p2p.hub.run import start as run_setup
    from echo2p2p.hub.tasks import task_setup

    cfg = hub_config(args, run_dir)
    baseline = rss.now("hub")  # Python, torch, transformers: before any model is loaded
    peers: list[asyncio.subprocess.Process] = []
    open_task, task_setup.open_task = task_setup.open_task, lambda *_, **__: CoinTask(seed=cfg.run.seed)
    with probes.installed(), contextlib.ExitStack() as undo:
        undo.callback(setattr, task_setup, "open_task", open_task)
        async with run_setup.start_hub(cfg, stream=open(os.devnull, "w")) as run:
            probes.run = run
            trained = freeze(run.learner.model, args.train_layers)
            try:
                async with asyncio.timeout(args.timeout_s):
                    for i in range(N_PEERS):
                        peers.append(await asyncio.create_subprocess_exec(
                            sys.executable, __file__, "--peer", run.url, "--name", f"rs-{i}",
                            "--model-dir", str(args.model_dir)))
                        rss.watch(f"peer rs-{i}", peers[-1].pid)
                    await run.finished.wait()
                    await probes.all_hold(run.hub.core.step, N_PEERS)
            finally:
                await stop(peers, grace_s=20)  # a peer may be mid-reload of 1.2 GB
                rss.stop()  # the peaks are the run's: the per-core rates below export again
            params = sum(p.numel() for p in run.learner.model.parameters())
            rates = await asyncio.to_thread(per_core_rates, run, run_dir / "versions")
    return {"params": params, "trained": trained, "rates": rates, "cfg": cfg,
            "baseline": baseline}


def engine_reloads(args: argparse.Namespace) -> list[dict]:
    """Each engine's reload in a process of its own (after the cluster has gone)."""
    import subprocess

    runs = [("transformers", sys.executable)]
    if VLLM_PYTHON.exists():
        runs.append(("vllm", str(VLLM_PYTHON)))
    out = []
    for kind, python in runs:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run([python, __file__, "--reload", kind, "--model-dir",
                               str(args.model_dir)], capture_output=True, text=True, env=env,
                              timeout=args.timeout_s)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"engine"')]
        if proc.returncode or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            out.append({"engine": kind, "error": tail[:200]})
        else:
            out.append(json.loads(lines[-1]))
    return out


def report(args: argparse.Namespace, facts: dict, probes: Probes, rss: RssSampler,
           reloads: list[dict], run_dir: Path) -> dict:
    cfg, p = facts["cfg"], facts["params"]
    versions = probes.versions(run_dir / "metrics.jsonl")
    print(f"\nQwen3-0.6B-shaped: P = {p / 1e6:.0f} M parameters, {2 * p / 1e9:.2f} GB in bf16; "
          f"{facts['trained'] / 1e6:.1f} M trained; {cfg.run.max_steps} steps, S = {cfg.staleness.max_lag}, "
          f"{N_PEERS} peers; {os.cpu_count()} CPUs\n")
    print(table(["v", "sent as", "exported", "stream on disk", "coded (full + delta s)",
                 "announced", "1st chunk out", "last chunk done", "reload s (per peer)",
                 "T_bcast s", "90 % serving"], [
        [v["version"], v["kind"], v["export_s"], v["stream_s"],
         f"{v['coded_s']} ({v['full_code_s']} + {v['delta_code_s']})", v["announce_s"],
         v["first_chunk_s"], v["last_chunk_s"], v["reload_s"], v["t_bcast_s"], v["serving_s"]]
        for v in versions]))
    print("  Seconds after the learner step ended, except reload (a peer's transfer report to its\n"
          "  VersionHeld) and T_bcast (announced -> 90 % of peers hold it, reload included; from\n"
          "  metrics.jsonl). Not streaming: every chunk is coded before the signed manifest goes.\n")
    rates = facts["rates"]
    print(table(["stage (1 thread)", "MB/s per core"], [[k, v] for k, v in rates.items()]))
    print(table(["engine", "build s", "reload s (3 runs)", "note"], [
        [r["engine"], r.get("build_s", "-"), r.get("reload_s", "-"), r.get("error", "")]
        for r in reloads]))
    predicted = predict(p, facts["trained"], cfg) + facts["baseline"]
    print(table(["process", "peak anon GB", "peak file GB", "predicted anon GB"], [
        [name, round(a / 1e9, 2), round(f / 1e9, 2), round(predicted / 1e9, 2) if name == "hub" else ""]
        for name, (a, f) in rss.peaks.items()]))
    return {"bench": "realsize", "params": p, "trained": facts["trained"], "steps": cfg.run.max_steps,
            "versions": versions, "rates_mb_s_per_core": rates, "engines": reloads,
            "peak_anon_gb": {k: round(a / 1e9, 2) for k, (a, _) in rss.peaks.items()},
            "hub_predicted_anon_gb": round(predicted / 1e9, 2)}


def predict(p: int, trained: int, cfg: object) -> float:
    """The docstring's RAM formula for the hub (without Python's own, measured apart)."""
    largest = QWEN3_0_6B["vocab_size"] * QWEN3_0_6B["hidden_size"]  # the tied embedding
    return (16 * trained + 4 * (p - trained) + (4 * p if cfg.trust.spot_check_fraction else 0)
            + 6 * largest)


def check_memory(model_dir: Path, spot: bool) -> str | None:
    """Why this box cannot run the cluster now (None: it can): the hub's RAM formula plus, per
    peer, ~6.5 bf16 copies (engine, 2 held streams and their chunks, the one assembling, the
    staged state; measured), against MemAvailable."""
    two_p = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    need = 0.6e9 + two_p * (2 + 1 + (2 if spot else 0)) + N_PEERS * (0.5e9 + 6.5 * two_p)
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) << 10
    if need <= available:
        return None
    return (f"the run needs about {need / 1e9:.1f} GB and {available / 1e9:.1f} GB are available: "
            f"free memory, use --spot-fraction 0, or pass --force")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 learner steps")
    ap.add_argument("--steps", type=int, default=4, help="learner steps (one version each)")
    ap.add_argument("--model-dir", type=Path,
                    default=Path.home() / ".cache" / "echo2p2p" / "qwen3-0.6b-shape")
    ap.add_argument("--train-layers", type=int, default=1,
                    help="decoder layers the learner trains, from the last (0 = all: 16 B/param)")
    ap.add_argument("--spot-fraction", type=float, default=0.25,
                    help="spot_check_fraction of the hub (its fp32 model copy is counted)")
    ap.add_argument("--layers", type=int, default=28,
                    help="decoder layers (28: Qwen3-0.6B; fewer only to smoke-test the bench)")
    ap.add_argument("--no-engines", action="store_true", help="skip the per-engine reloads")
    ap.add_argument("--force", action="store_true", help="run even if memory looks short")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="watchdog of the cluster run")
    ap.add_argument("--peer", help=argparse.SUPPRESS)  # internal: run one peer joined to this URL
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--reload", help=argparse.SUPPRESS)  # internal: time one engine's reload
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer:
        asyncio.run(peer_main(args))
        return 0
    if args.reload:
        reload_main(args)
        return 0
    if args.quick:
        args.steps = 2
    from echo2p2p.runtime import process

    process.configure("warning")
    if args.layers != 28:  # a smaller model for a smoke test of the bench, in its own dir
        args.model_dir = args.model_dir.with_name(f"{args.model_dir.name}-{args.layers}l")
    ensure_model(args.model_dir, args.layers)
    if not args.force and (why := check_memory(args.model_dir, args.spot_fraction > 0)):
        print(f"realsize: {why}", file=sys.stderr)
        return 2
    rss = RssSampler()
    with tempfile.TemporaryDirectory(prefix="realsize-") as workdir, rss:
        run_dir = Path(workdir) / "run"
        probes = Probes()
        facts = asyncio.run(run_cluster(args, run_dir, probes, rss))
        rss.stop()
        reloads = [] if args.no_engines else engine_reloads(args)
        result = report(args, facts, probes, rss, reloads, run_dir)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
