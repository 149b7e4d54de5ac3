"""What a peer k versions behind pays to catch up: one delta from its version, or the newest in full.

The model of bench/delta.py (a Qwen3-architecture model, >= 100 M parameters, or a small one
with --quick) takes 16 AdamW steps at lr 1e-6; the hub's `Publisher` publishes each bf16 cast
(full + delta against the previous, streams on disk as `start_hub` keeps them). For k = 1, 4
and 16, `hub.overlay.catchup.build_catch_up` builds the catch-up delta v(16 - k) -> v16, as the hub
does for a peer that holds v(16 - k) whole, and a receiver rebuilds v16 from it (chunk digests,
then the stream digest: bit for bit).

Time is measured encode (the hub, all cores) + decode (the peer: verify and rebuild every chunk,
then check the stream, one core), plus the transfer computed at --link-mbps (a peer's downlink;
on loopback a transfer would measure memory copies, not the network); the full download is
transfer + decode of the full snapshot (already built: nothing to encode). `k deltas` is what
fetching the k published deltas one after the other would move instead.

    python bench/catchup.py [--quick] [--link-mbps 100]

Prints a table, then one JSON line:
{"bench": "catchup", "rows": [{"k": 1, "delta_bytes": ..., "full_bytes": ..., "bytes_ratio": ...,
 "catch_up_s": ..., "full_s": ..., "time_ratio": ..., ...}, ...], ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.delta import build_model  # noqa: E402

STEPS = 16
KS = (1, 4, 16)


def publish_steps(quick: bool, lr: float, directory: Path) -> tuple[list, int]:
    """Every version the hub publishes over STEPS AdamW steps (the newest carries the kept
    streams of all of them), and the model's parameter count."""
    import torch

    from echo2p2p import signing
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.overlay.publisher import Publisher
    from echo2p2p.hub.overlay.versions import VersionFiles

    torch.set_num_threads(2)
    model = build_model(quick)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    cfg = HubConfig.from_flat(catch_up_versions=STEPS, anchor_every=STEPS + 1)
    publisher = Publisher(cfg.overlay, signing.new_private_key(),
                          files=VersionFiles(directory, keep_streams=1, keep_chunks=1))
    published = [publisher.build(0, model.state_dict())]
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)  # (B, T)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        published.append(publisher.build(step, model.state_dict()))
    return published, sum(t.numel() for t in model.parameters())


def rebuild_s(snap, base) -> tuple[float, bytes]:
    """Seconds a receiver takes to verify and rebuild `snap` (against `base`), and the stream."""
    from echo2p2p.assembler import ChunkAssembler

    start = time.perf_counter()
    assembler = ChunkAssembler(snap.manifest, base=base)
    for i, chunk in enumerate(snap.chunks):
        assembler.add(i, chunk)
    stream = assembler.stream()  # checks the manifest digest
    return time.perf_counter() - start, bytes(stream)


def measure(published: list, link_mbps: float) -> list[dict]:
    from echo2p2p.hub.overlay.catchup import build_catch_up

    newest = published[-1]
    streams = newest.bases.streams
    full_bytes = newest.full.wire_bytes
    full_decode_s, _ = rebuild_s(newest.full, None)
    full_s = full_bytes * 8 / (link_mbps * 1e6) + full_decode_s
    rows = []
    for k in KS:
        base = STEPS - k
        start = time.perf_counter()
        delta = build_catch_up(newest, base)
        encode_s = time.perf_counter() - start
        assert delta is not None, f"k = {k}: the delta is no smaller than the full version"
        decode_s, stream = rebuild_s(delta, streams[base])
        delta_bytes = delta.wire_bytes
        catch_up_s = encode_s + delta_bytes * 8 / (link_mbps * 1e6) + decode_s
        rows.append({
            "k": k, "delta_bytes": delta_bytes, "full_bytes": full_bytes,
            "k_deltas_bytes": sum(p.delta.wire_bytes for p in published[base + 1:]),
            "bytes_ratio": round(full_bytes / delta_bytes, 1), "encode_s": round(encode_s, 3),
            "decode_s": round(decode_s, 3), "catch_up_s": round(catch_up_s, 3),
            "full_s": round(full_s, 3), "time_ratio": round(full_s / catch_up_s, 2),
            "exact": stream == bytes(streams[STEPS])})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a ~10 M parameter model")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--link-mbps", type=float, default=100.0, help="the peer's downlink, Mbit/s")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="catchup-bench-") as tmp:
        published, n_params = publish_steps(args.quick, args.lr, Path(tmp))
        rows = measure(published, args.link_mbps)
    model_mb = len(published[-1].bases.streams[STEPS]) / 1e6
    print(f"model: {n_params / 1e6:.1f} M parameters, {model_mb:.1f} MB in bf16, AdamW lr "
          f"{args.lr:g}; link {args.link_mbps:g} Mbit/s (transfer computed, encode and decode "
          f"measured)")
    print(f"{'k':>3}{'delta MB':>10}{'k deltas MB':>13}{'full MB':>9}{'bytes x':>9}"
          f"{'encode s':>10}{'decode s':>10}{'catch-up s':>12}{'full s':>8}{'time x':>8}")
    for r in rows:
        print(f"{r['k']:>3}{r['delta_bytes'] / 1e6:>10.2f}{r['k_deltas_bytes'] / 1e6:>13.2f}"
              f"{r['full_bytes'] / 1e6:>9.1f}{r['bytes_ratio']:>9.1f}{r['encode_s']:>10.2f}"
              f"{r['decode_s']:>10.2f}{r['catch_up_s']:>12.2f}{r['full_s']:>8.2f}"
              f"{r['time_ratio']:>8.2f}")
    print(json.dumps({"bench": "catchup", "params": n_params, "lr": args.lr,
                      "link_mbps": args.link_mbps,
                      "time": "encode + decode measured, transfer computed at link_mbps",
                      "exact": all(r["exact"] for r in rows), "rows": rows}))


if __name__ == "__main__":
    main()
