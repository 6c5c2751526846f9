#!/usr/bin/env bash
# One GPU call for the fp8 tensor-core decode research design (issue 36 item 3; NOTES.md "fp8
# tensor-core decode"), from the checkout's root with PYTHONPATH already set (kvzip-formats,
# kvzip-kernels, kvzip-eval sources), results under $OUT/fp8mma/ (< 240 s in all):
#   1. builds fp8mma.cu for this GPU (nvcc, ~1 s) and today's v6 kernel (kvzip_kernels._cuda);
#   2. checks both variants (f8: m16n8k32 e4m3, q and P hi + lo; cvt: e4m3 -> f16, m16n8k16)
#      against the float64 reference of the same quantised data, max abs error within the
#      tolerance fp8mma.tolerance derives (exit status 1 if any fails);
#   3. times them (CUDA events, median of ITERS calls after 5 warm-up) beside v6's `4bit`
#      (kvzip_kernels.plan(...).run) on equal shapes: 8B (8 KV / 32 q heads, d128) at batch 8
#      and 32, contexts 32k and 128k; 70B-TP8 (1 / 8) at batch 8, 32k; page size 16.
# Files: fp8mma_gpu.{json,md}, gpu.log, and the loop's SASS for this machine's nvcc
# (fp8mma_sass.{json,md}; cuobjdump from the CUDA toolkit or Triton's bundle).
set -uo pipefail
: "${OUT:?set OUT}"
D=$OUT/fp8mma
mkdir -p "$D"
HERE=packages/kvzip-kernels/benchmarks/fp8mma
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$D/gpu.log"
timeout "${LIMIT_S:-200}" python3 "$HERE/fp8mma.py" gpu --out "$D" --cache /tmp/fp8mma-build \
  --iters "${ITERS:-20}" --warmup 5 ${GPU_ARGS:-} 2>&1 | tee -a "$D/gpu.log"
rc=${PIPESTATUS[0]}
timeout 30 python3 "$HERE/fp8mma.py" sass --out "$D" >> "$D/gpu.log" 2>&1 || true
exit "$rc"
