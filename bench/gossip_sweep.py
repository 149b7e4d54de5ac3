"""Tracker, gossip and the striped chain at 8..256 emulated peers: hub control messages and bytes
per version, hub upload in copies, time / (M/B) and over the max-flow bound. One process, a
discrete-event emulation that runs the REAL pure cores (`bench.emulated_peers`, in the network
of `bench.emulation`, whose docstring says what is modelled): for the tracker and the chain
`echo2p2p.relay.Broadcast` (the hub's plans: one shared, or one per ring member) and one
`echo2p2p.failover.Failover` per peer; for gossip `echo2p2p.relay.gossip_plan` (the hub's
dealing) and one `echo2p2p.gossip.Swarm` per peer. Modes: uniform uplinks, "heterogeneous"
(a third at B/4), half NAT'd. Faults, at 30 % of the strategy's own
uniform time: "churn", 1/8 of the peers leave at once; "cut_churn", the same with the hub's
control connection cut; "hub_cut_30pct" (gossip), the control connection cut and the chunk
route gone once every chunk has left the hub once. Times count the peers that stayed.

    python bench/gossip_sweep.py [--quick] [--ns 8,16] [--mbit 100] [--latency-ms 10,100]
        [--queue-kib 0] [--chunks 54] [--chunk-mib 4]
    (--quick: N up to 64, 25 s of CPU; 8..256: 95 s)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, when run as a file

from bench.emulated_peers import run_chain, run_gossip, run_tracker  # noqa: E402
from bench.emulation import Result, Setup, members_of  # noqa: E402

# --- the sweep -----------------------------------------------------------------------------


def bound_s(setup: Setup, rates: dict[str, float]) -> float:
    """The max-flow lower bound of a broadcast from one hub (Kumar and Ross, 2006): the hub sends
    every byte once, and the N * M bytes received come from the hub's and the peers' uplinks."""
    m_bits = setup.n_chunks * setup.chunk_bytes * 8
    return max(m_bits / setup.hub_bps, setup.n_peers * m_bits / (setup.hub_bps + sum(rates.values())))


def row(case: str, setup: Setup, res: Result) -> dict:
    _, rates = members_of(setup)
    return {"case": case, "strategy": res.strategy, "n": setup.n_peers, "chunks": setup.n_chunks,
            "complete": res.complete, "t_over_mb": round(res.time_s / setup.m_over_b_s, 3),
            "t_over_bound": round(res.time_s / bound_s(setup, rates), 3),
            "hub_msgs": res.hub_msgs, "hub_kb": round(res.hub_bytes / 1e3, 1),
            "plan_kb": round(res.hub_plan_bytes / 1e3, 1), "hub_copies": round(res.hub_copies, 3),
            "hub_chunk_requests": res.hub_chunk_requests,
            "p2p_msgs_per_peer": round(res.p2p_msgs / setup.n_peers, 1),
            "p2p_kb_per_peer": round(res.p2p_bytes / setup.n_peers / 1e3, 1)}


STRATEGIES = {"tracker": run_tracker, "gossip": run_gossip, "chain": run_chain}


def sweep(ns: list[int], n_chunks: int, chunk_bytes: int, **net) -> list[dict]:
    """Per N: the three strategies on uniform uplinks, "heterogeneous" (a third at B/4, as
    bench/broadcast.py's mode, over the max-flow bound) and half-NAT'd peers; then, at 30 % of
    each strategy's own uniform time, 1/8 of the peers leaving ("churn"), the same with the
    hub's control connection cut (its chunk route still answers), and for gossip the case the
    issue names: the control connection cut and the chunk route gone once the seed copy is out.
    The hub knows its own rate (`Broadcast.hub_bps`), as a hub with an upload cap does; `net`:
    the rates, latencies and queues (`Setup`'s peer_bps, hub_bps, latency_s,
    uplink_queue_bytes)."""
    rows = []
    for n in ns:
        def setup(**kw) -> Setup:
            return Setup(n, n_chunks, chunk_bytes, hub_bps_known=net.get("hub_bps", 100e6),
                         **net, **kw)
        cases = {"uniform": setup(), "heterogeneous": setup(slow_fraction=1 / 3),
                 "nat_half": setup(nat_fraction=0.5)}
        for run in STRATEGIES.values():
            results = {case: run(s) for case, s in cases.items()}
            rows += [row(case, cases[case], res) for case, res in results.items()]
            at = 0.3 * results["uniform"].time_s
            faults = {"churn": setup(leave_at_s=at), "cut_churn": setup(cut_at_s=at, leave_at_s=at)}
            if run is run_gossip:
                faults["hub_cut_30pct"] = setup(cut_at_s=at, route_goes=True)
            rows += [row(case, s, run(s)) for case, s in faults.items()]
        print(f"  N={n} done", file=sys.stderr, flush=True)
    return rows


def scale_sweep(ns: list[int]) -> dict:
    """bench/broadcast.py's part 2 (`--scale`): the same pure cores at `ns` emulated peers
    (loss-free token buckets at 100 Mbit/s, one-way latency 10-100 ms per pair, i.e. RTT
    20-200 ms, a 113 M bf16 version in 216 chunks of 1 MiB; the hub would cut it in 256 KiB,
    which costs the emulation 4x the CPU): time / (M/B) and hub upload in copies."""
    out: dict[str, dict] = {"pipelined": {}, "gossip": {}, "striped-chain": {}}
    for n in ns:
        setup = Setup(n, n_chunks=216, chunk_bytes=1 << 20)
        for strategy, run in (("pipelined", run_tracker), ("gossip", run_gossip),
                              ("striped-chain", run_chain)):
            res = run(setup)
            out[strategy][n] = {"ratio_to_ideal": round(res.time_s / setup.m_over_b_s, 3),
                                "hub_upload_copies": round(res.hub_copies, 3),
                                "complete": res.complete}
            print(f"scale sweep   {strategy:13s} N={n:3d}  ratio "
                  f"{out[strategy][n]['ratio_to_ideal']:6.2f}  hub copies "
                  f"{out[strategy][n]['hub_upload_copies']:5.2f}", flush=True)
    return out


COLUMNS = ("n", "chunks", "case", "strategy", "complete", "t_over_mb", "t_over_bound", "hub_msgs",
           "hub_kb", "plan_kb", "hub_copies", "hub_chunk_requests", "p2p_msgs_per_peer")


def table(rows: list[dict]) -> str:
    lines = [" ".join(f"{c:>12}" for c in COLUMNS)]
    lines += [" ".join(f"{str(r[c]):>12}" for c in COLUMNS) for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy, colour in (("tracker", "tab:red"), ("gossip", "tab:blue"),
                             ("chain", "tab:green")):
        for case, style in (("uniform", "-"), ("heterogeneous", "--"), ("nat_half", ":")):
            pts = [r for r in rows if r["strategy"] == strategy and r["case"] == case]
            ns = [r["n"] for r in pts]
            if case == "uniform":
                ax1.plot(ns, [r["hub_kb"] for r in pts], style, color=colour, marker="o",
                         label=f"{strategy}: all hub control")
                ax1.plot(ns, [r["plan_kb"] for r in pts], "--", color=colour, marker="x",
                         label=f"{strategy}: plans only")
            ax2.plot(ns, [r["t_over_bound"] for r in pts], style, color=colour, marker="o",
                     label=f"{strategy} {case}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peers N")
        ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("hub control kB per version")
    ax2.set_ylabel("time to all complete / max-flow bound")
    fig.suptitle(f"emulated broadcast, {rows[0]['chunks']} chunks (bench/gossip_sweep.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 8..64 only")
    ap.add_argument("--chunks", type=int, default=54, help="chunks per version")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="MiB per chunk")
    ap.add_argument("--mbit", type=float, default=100.0, help="every uplink, Mbit/s")
    ap.add_argument("--latency-ms", default="10,100",
                    help="one-way latency per pair of hosts, drawn in this range (ms); "
                         "'0.2,1' with --mbit 20 --chunks 128 --chunk-mib 0.0625 is "
                         "bench/broadcast.py's 8 MiB under tbf")
    ap.add_argument("--queue-kib", type=int, default=0,
                    help="control frames wait behind this much data in a busy uplink (tbf: 256)")
    ap.add_argument("--ns", help="comma-separated N (default 8..256, --quick 8..64)")
    ap.add_argument("--plot", default=str(Path(__file__).with_name("gossip_sweep.png")))
    args = ap.parse_args(argv)
    ns = [8, 16, 32, 64] if args.quick else [8, 16, 32, 64, 128, 256]
    ns = [int(n) for n in args.ns.split(",")] if args.ns else ns
    low, high = (float(x) / 1e3 for x in args.latency_ms.split(","))
    net = {"peer_bps": args.mbit * 1e6, "hub_bps": args.mbit * 1e6, "latency_s": (low, high),
           "uplink_queue_bytes": args.queue_kib << 10}
    rows = sweep(ns, args.chunks, int(args.chunk_mib * (1 << 20)), **net)
    quarter = int(args.chunk_mib * (1 << 18))  # the same version in chunks of a quarter
    fine = [row(case, s, run(s)) for n in (16, 32) for case, s in
            (("uniform_1mib", Setup(n, args.chunks * 4, quarter, **net)),)
            for run in STRATEGIES.values()]
    print(table(rows + fine))
    if args.plot:
        plot(rows, Path(args.plot))
    pick = {(r["case"], r["strategy"], r["n"]): r for r in rows + fine}

    def series(case: str, strategy: str, key: str) -> dict:
        return {n: pick[(case, strategy, n)][key] for n in ns if (case, strategy, n) in pick}
    out = {"bench": "gossip_sweep", "chunks": args.chunks, "chunk_mib": args.chunk_mib,
           "peer_mbps": args.mbit, "hub_mbps": args.mbit, "latency_ms": args.latency_ms,
           "queue_kib": args.queue_kib}
    for strategy in STRATEGIES:
        out[f"{strategy}_hub_msgs"] = series("uniform", strategy, "hub_msgs")
        out[f"{strategy}_hub_kb"] = series("uniform", strategy, "hub_kb")
        out[f"{strategy}_plan_kb"] = series("uniform", strategy, "plan_kb")
        out[f"{strategy}_hub_copies"] = series("uniform", strategy, "hub_copies")
        for case in ("uniform", "heterogeneous", "nat_half", "churn", "cut_churn"):
            out[f"{strategy}_{case}_t_over_mb"] = series(case, strategy, "t_over_mb")
        out[f"{strategy}_heterogeneous_t_over_bound"] = series("heterogeneous", strategy,
                                                               "t_over_bound")
        out[f"{strategy}_heterogeneous_hub_copies"] = series("heterogeneous", strategy,
                                                             "hub_copies")
        for case in ("churn", "cut_churn"):
            out[f"{strategy}_{case}_hub_msgs"] = series(case, strategy, "hub_msgs")
            out[f"{strategy}_{case}_hub_copies"] = series(case, strategy, "hub_copies")
            out[f"{strategy}_{case}_complete"] = series(case, strategy, "complete")
    out["gossip_nat_half_hub_copies"] = series("nat_half", "gossip", "hub_copies")
    out["gossip_hub_cut_complete"] = series("hub_cut_30pct", "gossip", "complete")
    out["gossip_hub_cut_t_over_mb"] = series("hub_cut_30pct", "gossip", "t_over_mb")
    out["uniform_1mib_t_over_mb"] = {f"{r['strategy']}_{r['n']}": r["t_over_mb"] for r in fine}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
