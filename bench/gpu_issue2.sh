#!/usr/bin/env bash
# Issue 2's GPU checks, one call on the device machine: the demo, then the single-GPU test suite.
# Usage (from the repo root): OUT=/some/dir bash bench/gpu_issue2.sh
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/autopar-out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } | tee "$OUT/env.txt"
/usr/bin/time -f "demo wall %e s" python3 -m autopar.cli demo --steps 30 2>&1 | tee "$OUT/demo.log"
python3 -m pytest tests/gpu -q -rfEs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
