#!/usr/bin/env bash
# One short check of the GPU path, prepared for a lent CUDA machine (under 8 minutes): SmolLM2-135M
# on the hub's learner in bf16 (over fp32 master weights) and ONE vLLM peer on the same GPU in
# bf16 (vLLM's GPU default), 4 steps with every group spot-checked by the hub's rule for bf16
# engines, a held-out evaluation (50 problems) before and after. One JSON file
# (bench/real_engines.py's, --device cuda --no-probe): spot-checked / failed, the peer's
# in-place update time per version ("swapped in"), announcement-to-serving time, engine start,
# accuracy. Without CUDA it exits at once, code 2, with a sentence.
#   bench/gpu_check.sh [OUT.json]      (default bench/gpu_check.json)
# PYTHON: the hub's interpreter (default .venv/bin/python); the peer's is found as `echo2-hub
# demo --engine vllm` finds it ($ECHO2_VLLM_PYTHON, .venv-vllm, this Python) and must have a
# CUDA vLLM (pip install 'echo2p2p[vllm]'), not the CPU wheel of .ci/vllm-env.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/gpu_check.json}"
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
no_gpu() {
    echo "gpu_check: $1: this check needs a CUDA GPU (on a CPU machine run:" \
         "python bench/real_engines.py)" >&2
    exit 2
}
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || no_gpu "no NVIDIA GPU here"
"$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
    || no_gpu "$python has no CUDA torch"
peer=$("$python" -c 'from echo2p2p.hub.run import peer_python; print(peer_python("vllm"))' \
       2>/dev/null) || no_gpu "no Python with vLLM found (set ECHO2_VLLM_PYTHON)"
"$peer" -c 'import sys, torch, vllm; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
    || no_gpu "$peer has no CUDA vLLM (set ECHO2_VLLM_PYTHON to one that has)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2
# 420 s for the run (the hub stops the peer at its end); 60 s more before anything is killed.
ECHO2_VLLM_PYTHON="$peer" exec timeout --kill-after=20 460 "$python" bench/real_engines.py \
    --engines vllm --device cuda --steps 4 --eval-problems 50 --no-probe --timeout-s 420 \
    --out "$out"
