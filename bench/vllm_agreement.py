"""How closely a real vLLM's sampled logprobs match the hub's recompute, by engine dtype.

Runs the vLLM tests' harness session (tests/vllm/harness.py: the built-in model, 6 addition
prompts x 8 samples at T = 1 and at T = 0.7 / top-p 0.9) under the vLLM environment's Python
(`.ci/vllm-env`, or ECHO2_VLLM_PYTHON), once per engine dtype, and compares every token's
logprob with the hub's fp32 forward of the same weights: |difference| per token and the
spot-check's per-group mean (median, p99, max). float32 is what the CI tests hold to 1e-4; a
bfloat16 engine computes as GPU peers do, which is what `spot_check_tolerance` must admit.

    python bench/vllm_agreement.py [--dtypes float32 bfloat16]

Prints one table per dtype, then one JSON line {"bench": "vllm_agreement", dtype: rows}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import markdown_table  # noqa: E402
from tests.vllm.conftest import vllm_python  # noqa: E402
from tests.vllm.test_engine import agreement, run_session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    python = vllm_python()
    if python is None:
        sys.exit("no vLLM environment: run .ci/vllm-env (or set ECHO2_VLLM_PYTHON)")
    out = {}
    for dtype in args.dtypes:
        with tempfile.TemporaryDirectory() as work:
            session = run_session(python, Path(work), dtype)
            rows = asyncio.run(agreement(*session))
        print(f"\nvLLM ({dtype}) vs the hub's fp32 recompute, |logprob difference| in nats; "
              f"engine start {session[0]['start_s']:.0f} s, reload {session[0]['reload_s']:.3f} s")
        print("\n".join(markdown_table(rows)))
        out[dtype] = [dict(zip(rows[0], row)) for row in rows[1:]]
    print(json.dumps({"bench": "vllm_agreement", **out}))


if __name__ == "__main__":
    main()
