"""How small a lossless delta between two published bf16 versions is, and how fast it codes.

A Qwen3-architecture model (random init; >= 100 M parameters, or a small one with --quick) with
fp32 master weights takes AdamW steps at lr 1e-6 on real gradients (next-token loss on random
tokens). After every step its bf16 cast is a "published version". Each codec of
`echo2p2p.delta` encodes version t against version t - 1 (publication every step) and t against
t - 4 (every 4 steps), chunk by chunk (1 MiB raw, each chunk its own delta, as a relay
forwards them); decoding must give back the new version bit for bit.

    python bench/delta.py [--quick] [--steps 8]

Prints a table, then one JSON line:
{"bench": "delta", "compression_ratio": ..., "exact": ..., "encode_MBps": ..., "decode_MBps": ...}
where compression_ratio is full bf16 bytes / delta bytes for the every-step case with the better
codec, and MB/s are of full bf16 bytes on one core (one thread).
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a ~10 M parameter model")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (>= 4)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="raw bytes per delta chunk")
    args = p.parse_args(argv)

    import torch

    from echo2p2p import delta

    torch.set_num_threads(2)
    model = build_model(args.quick)
    n_params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)
    versions = [bf16_stream(model)]
    for _ in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)  # (B, T)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        versions.append(bf16_stream(model))
    full = len(versions[0])

    torch.set_num_threads(1)
    rows, exact = [], True
    for label, gap in (("every step", 1), ("every 4 steps", 4)):
        pairs = [(versions[t], versions[t - gap]) for t in range(gap, len(versions), gap)]
        changed = sum(delta.changed_fraction(n, b) for n, b in pairs) / len(pairs)
        for codec in delta.CODECS:
            size = enc_s = dec_s = 0.0
            for new, base in pairs:
                for at in range(0, full, args.chunk_bytes):  # independent chunks, as relayed
                    n_view = memoryview(new)[at:at + args.chunk_bytes]
                    b_view = memoryview(base)[at:at + args.chunk_bytes]
                    t0 = time.perf_counter()
                    d = delta.encode(n_view, b_view, codec=codec)
                    t1 = time.perf_counter()
                    rebuilt = delta.decode(d, b_view)
                    dec_s += time.perf_counter() - t1
                    exact &= rebuilt == n_view.tobytes()
                    enc_s += t1 - t0
                    size += len(d)
            n = len(pairs)
            rows.append({"publish": label, "codec": codec, "changed": changed,
                         "ratio": full * n / size, "encode_MBps": full * n / enc_s / 1e6,
                         "decode_MBps": full * n / dec_s / 1e6})

    print(f"model: {n_params / 1e6:.1f} M parameters, {full / 1e6:.1f} MB in bf16, AdamW lr "
          f"{args.lr:g}, {args.steps} steps")
    print(f"{'publish':<15}{'codec':<8}{'changed':>9}{'ratio':>9}{'enc MB/s':>10}{'dec MB/s':>10}")
    for r in rows:
        print(f"{r['publish']:<15}{r['codec']:<8}{r['changed']:>9.4f}{r['ratio']:>9.1f}"
              f"{r['encode_MBps']:>10.0f}{r['decode_MBps']:>10.0f}")
    best = max((r for r in rows if r["publish"] == "every step"), key=lambda r: r["ratio"])
    print(json.dumps({"bench": "delta", "compression_ratio": round(best["ratio"], 1),
                      "exact": bool(exact), "encode_MBps": round(best["encode_MBps"]),
                      "decode_MBps": round(best["decode_MBps"]), "codec": best["codec"],
                      "params": n_params, "lr": args.lr, "changed_fraction": best["changed"]}))


if __name__ == "__main__":
    main()
