"""How small a lossless delta between two published bf16 versions is, and how fast it codes.

A Qwen3-architecture model (random init; >= 100 M parameters, or a small one with --quick) with
fp32 master weights takes AdamW steps at lr 1e-6 on real gradients (next-token loss on random
tokens). After every step its bf16 cast is a "published version". Each codec of
`echo2p2p.delta` encodes version t against version t - 1 (publication every step) and t against
t - 4 (every 4 steps), chunk by chunk (1 MiB raw, each chunk its own delta, as a relay
forwards them); decoding must give back the new version bit for bit.

"bound" is full bytes / the order-0 entropy of the deltas (`delta.entropy_bound_bytes` of each
chunk: a changed/unchanged coin per word plus the measured step frequencies), what a coder of
independent symbols cannot beat; "ctx bound" draws the coin per exponent of the base word, a
finer model that no codec here uses, to show what is left beyond the order-0 bound.

    python bench/delta.py [--quick] [--steps 8]

Prints a table, then one JSON line:
{"bench": "delta", "compression_ratio": ..., "entropy_bound_ratio": ..., "exact": ...,
 "encode_MBps": ..., "decode_MBps": ..., ...}
where compression_ratio is full bf16 bytes / delta bytes for the every-step case with the best
codec, entropy_bound_ratio full bytes / bound bytes for that case, and MB/s are of full bf16
bytes on one core (one thread). The "auto" rows are `encode` as a publisher calls it: every
codec tried and the smallest kept (auto_encode_MBps in the JSON line).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(quick: bool):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    size = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4) if quick else \
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=14)
    config = Qwen3Config(vocab_size=32_000, num_attention_heads=size["hidden_size"] // 64,
                         num_key_value_heads=4 if not quick else 2, head_dim=64,
                         tie_word_embeddings=True, **size)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


def bf16_stream(model) -> bytes:
    """The bytes a snapshot of this version carries, as `echo2p2p.policy.weights` lays them out."""
    from echo2p2p.policy.weights import state_to_tensors

    return b"".join(bytes(raw) for _, _, _, raw in state_to_tensors(model.state_dict()))


def train_versions(quick: bool, steps: int, lr: float) -> tuple[int, list[bytes]]:
    """(parameters, the bf16 stream of the initial version and after each AdamW step)."""
    import torch

    torch.set_num_threads(2)
    model = build_model(quick)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    versions = [bf16_stream(model)]
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)  # (B, T)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        versions.append(bf16_stream(model))
    torch.set_num_threads(1)
    return sum(t.numel() for t in model.parameters()), versions


def chunk_pairs(pairs: list[tuple[bytes, bytes]], chunk_bytes: int):
    """(new, base) views of every chunk of every pair, as a relay forwards them."""
    for new, base in pairs:
        for at in range(0, len(new), chunk_bytes):
            yield memoryview(new)[at:at + chunk_bytes], memoryview(base)[at:at + chunk_bytes]


def code_all(pairs, chunk_bytes: int, codec: str) -> tuple[int, float, float, bool]:
    """(delta bytes, encode s, decode s, every chunk rebuilt bit for bit) for one codec."""
    from echo2p2p import delta

    size, enc_s, dec_s, exact = 0, 0.0, 0.0, True
    for new, base in chunk_pairs(pairs, chunk_bytes):
        t0 = time.perf_counter()
        d = delta.encode(new, base, codec=codec)
        t1 = time.perf_counter()
        rebuilt = delta.decode(d, base)
        dec_s += time.perf_counter() - t1
        enc_s += t1 - t0
        exact &= rebuilt == new
        size += len(d)
    return size, enc_s, dec_s, exact


def _bits(counts) -> float:
    return -sum(c * math.log2(c / sum(counts)) for c in counts if c)


def entropy_bounds(pairs, chunk_bytes: int) -> tuple[float, float]:
    """Bytes summed over chunks: the order-0 bound, and the same with the changed/unchanged coin
    drawn per exponent (bits 7-14) of the base word."""
    import numpy as np

    from echo2p2p import delta

    plain = ctx = 0.0
    for new, base in chunk_pairs(pairs, chunk_bytes):
        bound = delta.entropy_bound_bytes(new, base)
        a, b = np.frombuffer(new, "<u2"), np.frombuffer(base, "<u2")
        exponent = ((b >> 7) & 0xFF).astype(np.intp)
        words = np.bincount(exponent, minlength=256)
        changed = np.bincount(exponent[a != b], minlength=256)
        coin = _bits([int(changed.sum()), a.size - int(changed.sum())])
        per_exponent = sum(_bits([int(c), int(w - c)]) for c, w in zip(changed, words))
        plain += bound
        ctx += bound + (per_exponent - coin) / 8
    return plain, ctx


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a ~10 M parameter model")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (>= 4)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="raw bytes per delta chunk")
    args = p.parse_args(argv)

    from echo2p2p import delta

    n_params, versions = train_versions(args.quick, args.steps, args.lr)
    full = len(versions[0])
    rows, exact = [], True
    for label, gap in (("every step", 1), ("every 4 steps", 4)):
        pairs = [(versions[t], versions[t - gap]) for t in range(gap, len(versions), gap)]
        changed = sum(delta.changed_fraction(n, b) for n, b in pairs) / len(pairs)
        n = len(pairs)
        bound, ctx = entropy_bounds(pairs, args.chunk_bytes)
        for codec in (*delta.CODECS, None):  # None: every codec tried, the smallest kept
            size, enc_s, dec_s, ok = code_all(pairs, args.chunk_bytes, codec)
            exact &= ok
            rows.append({"publish": label, "codec": codec or "auto", "changed": changed,
                         "ratio": full * n / size, "bound": full * n / bound,
                         "ctx_bound": full * n / ctx, "encode_MBps": full * n / enc_s / 1e6,
                         "decode_MBps": full * n / dec_s / 1e6})

    print(f"model: {n_params / 1e6:.1f} M parameters, {full / 1e6:.1f} MB in bf16, AdamW lr "
          f"{args.lr:g}, {args.steps} steps, {args.chunk_bytes} B chunks")
    print(f"{'publish':<15}{'codec':<8}{'changed':>9}{'ratio':>9}{'bound':>9}{'ctx bound':>11}"
          f"{'enc MB/s':>10}{'dec MB/s':>10}")
    for r in rows:
        print(f"{r['publish']:<15}{r['codec']:<8}{r['changed']:>9.4f}{r['ratio']:>9.1f}"
              f"{r['bound']:>9.1f}{r['ctx_bound']:>11.1f}{r['encode_MBps']:>10.0f}"
              f"{r['decode_MBps']:>10.0f}")
    best = max((r for r in rows if r["publish"] == "every step" and r["codec"] != "auto"),
               key=lambda r: r["ratio"])
    auto = next(r for r in rows if r["publish"] == "every step" and r["codec"] == "auto")
    print(json.dumps({"bench": "delta", "compression_ratio": round(best["ratio"], 1),
                      "entropy_bound_ratio": round(best["bound"], 1),
                      "context_bound_ratio": round(best["ctx_bound"], 1),
                      "exact": bool(exact), "encode_MBps": round(best["encode_MBps"]),
                      "decode_MBps": round(best["decode_MBps"]), "codec": best["codec"],
                      "auto_encode_MBps": round(auto["encode_MBps"]),
                      "params": n_params, "lr": args.lr, "changed_fraction": best["changed"]}))


if __name__ == "__main__":
    main()
