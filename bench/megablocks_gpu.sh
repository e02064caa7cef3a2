#!/usr/bin/env bash
# Every open GPU check, as one script (about 10 minutes on one H100/H200):
#   1. GRPO on CUDA: a few steps in bf16 with and without the reference model (tests marked gpu),
#   2. build megablocks against the installed torch (no torch upgrade),
#   3. run the `gpu`-marked MoE tests (megablocks forward and backward vs the pure-torch reference),
#   4. measure tokens/s of megablocks vs the reference vs transformers' own MoE forward+backward at
#      the dipaco-16x16-150m preset (bench/moe_speed.py), printing the ratios.
# Usage: bash bench/megablocks_gpu.sh   (writes bench/out/moe_speed.jsonl)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q "torch>=2.4,<2.15"
    PY=.venv/bin/python
fi
TORCH=$($PY -c "import torch; print(torch.__version__.split('+')[0])")
$PY -m pip install -q -e ".[dev,math]" "torch==$TORCH"
timeout 300 $PY -m pytest -q -m gpu tests/paths/work/test_grpo_rollouts.py
# megablocks' wheel pins its own torch; build it against ours instead
$PY -m pip install -q --no-build-isolation --no-deps "megablocks>=0.10" stanford-stk grouped_gemm || {
    echo "megablocks did not build against torch $TORCH"; exit 1; }
timeout 300 $PY -m pytest -q -m gpu tests/experts/test_moe.py
timeout 300 $PY bench/moe_speed.py --preset dipaco-16x16-150m
