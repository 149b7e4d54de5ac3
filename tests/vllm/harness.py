"""Drives a real VLLMEngine through one scripted session, in the vLLM environment.

`python tests/vllm/harness.py SPEC.json OUT.json`, run by tests/vllm under the vLLM venv's
Python (vLLM pins a transformers of its own, so it cannot live in the test process). The spec
names a model directory, a second version's weights (a safetensors file) and prompt ids; the
harness writes what the engine did, and the tests compare it with the hub's own forward pass
on the same weights in the test process. Steps, in order (one engine start, ~30-60 s on CPU):
  sample    every prompt, group of G, at each (temperature, top_p) of the spec, version 0
  seeds     one prompt three times: seed a, seed a again, seed b
  warm      the long prompt sampled under version 0 (fills the prefix cache with its KV), and
            how many of its tokens a second request then finds cached
  update    version 1 loaded; how many are cached now; the long prompt sampled (T = 1) and
            decoded near-greedily
  refused   a state of a wrong shape is refused before anything is copied; the long prompt again
  broken    a copy that fails half-way (a meta tensor last); generation refused until ...
  restored  ... version 1 is loaded in full; the long prompt again
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    import torch
    from safetensors.torch import load_file

    from echo2p2p.policy.engines import VLLMEngine

    spec = json.loads(open(spec_path).read())
    started = time.perf_counter()
    engine = VLLMEngine(spec["model"], device="cpu", dtype=spec.get("dtype", "auto"))
    out: dict = {"start_s": time.perf_counter() - started}
    g, new = spec["group_size"], spec["max_new_tokens"]

    def sample(ids, *, temperature=1.0, top_p=1.0, seed=0, n=g):
        done = engine.generate(ids, n, temperature=temperature, top_p=top_p,
                               max_new_tokens=new, seed=seed)
        return [{"ids": c.token_ids, "logprobs": c.logprobs, "finish": c.finish_reason}
                for c in done]

    out["sample"] = [{"temperature": t, "top_p": p,
                      "groups": [sample(ids, temperature=t, top_p=p, seed=100 + k)
                                 for k, ids in enumerate(spec["prompts"])]}
                     for t, p in spec["settings"]]
    first = spec["prompts"][0]
    out["seeds"] = [sample(first, seed=s) for s in (7, 7, 8)]
    long = spec["long_prompt"]
    out["warm"] = sample(long, seed=1)
    out["warm_cached"] = _cached_tokens(engine, long)  # > 0: the prefix cache holds its KV
    v1 = load_file(spec["v1"])
    started = time.perf_counter()
    engine.load_weights(v1)
    out["reload_s"] = time.perf_counter() - started
    out["update_cached"] = _cached_tokens(engine, long)  # 0: none of it survived the update
    out["update"] = {"sampled": sample(long, seed=2), "greedy": sample(long, temperature=1e-3,
                                                                       seed=3, n=1)}
    wrong = {name: torch.zeros(t.shape[0] + 1, *t.shape[1:]) if name.endswith("norm.weight")
             else t for name, t in v1.items()}
    out["refused"] = {"error": _error(lambda: engine.load_weights(wrong)),
                      "greedy": sample(long, temperature=1e-3, seed=3, n=1)}
    names = list(v1)
    half = {**{name: v1[name] for name in names[:-1]},
            names[-1]: torch.empty(v1[names[-1]].shape, device="meta")}
    out["broken"] = {"error": _error(lambda: engine.load_weights(half)),
                     "generate": _error(lambda: sample(long, seed=3, n=1))}
    engine.load_weights(v1)
    out["restored"] = {"greedy": sample(long, temperature=1e-3, seed=3, n=1)}
    with open(out_path, "w") as f:
        json.dump(out, f)


def _cached_tokens(engine, ids: list[int]) -> int:
    """Prompt tokens of `ids` that vLLM served from its prefix cache on a one-token request."""
    from vllm import SamplingParams

    (request,) = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1),
                                     use_tqdm=False)
    return int(request.num_cached_tokens or 0)


def _error(call) -> str | None:
    """The error `call` raised, as 'Type: message', or None if it returned."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        return f"{type(exc).__name__}: {exc}"
    return None


if __name__ == "__main__":  # vLLM may spawn processes: only the main module runs the session
    main(*sys.argv[1:])
