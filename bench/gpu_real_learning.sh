#!/usr/bin/env bash
# The real-model bench on a CUDA machine: hub learner on the GPU (bf16 over fp32 master weights),
# one local vLLM peer on the same GPU, a bigger batch and longer completions; TRL's arm on the
# GPU too (transformers' generate). Writes bench/real_learning.py's JSON line to OUT.json.
#   bench/gpu_real_learning.sh OUT.json [more bench/real_learning.py flags, e.g. --steps 20]
# PYTHON picks the interpreter (default .venv/bin/python); vLLM is found as `echo2-hub demo
# --engine vllm` finds it ($ECHO2_VLLM_PYTHON, .venv-vllm, or this Python).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/gpu_real_learning.sh OUT.json [bench/real_learning.py flags]}"
shift
python="${PYTHON:-.venv/bin/python}"
if ! nvidia-smi -L >/dev/null 2>&1 \
   || ! "$python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "gpu_real_learning: no CUDA device visible to $python: this bench needs a GPU" \
         "(on a CPU machine run: python bench/real_learning.py --quick)" >&2
    exit 2
fi
exec "$python" bench/real_learning.py --peers 1 --out "$out" \
    --set prompts_per_step=32 --set max_new_tokens=256 \
    --hub-flag=--engine=vllm --hub-flag=--device=cuda --hub-flag=--learner-precision=bf16 \
    "$@"
