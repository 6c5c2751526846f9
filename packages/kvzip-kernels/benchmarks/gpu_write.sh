#!/usr/bin/env bash
# One H200 call for the compact formats' cache-write (issue 27 item 5), from the checkout's
# root, results under $OUT (about 3-4 minutes, at most 6.5 by the timeouts):
#   1. the write's tests on the GPU (their interpreter twins ran on the CPU): the one-kernel
#      write's gpu cases (4,099 tokens x 8 heads, every compact format and kind, two configs,
#      vLLM's and random slots), its ties / zero-row / bias and rejected-row cases compiled,
#      and the shipped split path's gpu cases (tests/test_cache_write.py -m gpu)  (~60-120 s)
#   2. bench_cache_write.py: fp8, int4 and the compact formats' split (shipped), fused (FMA
#      transform) and compact (tensor-core transform: 128/8/2 persistent = the default,
#      64/4/2 persistent, 128/8/1 one program per tile) writes against a prefill layer of
#      the same tokens, 2k/8k/32k tokens, vLLM's slot pattern and random slots, in one
#      process (mostly Triton compiles: 18 of the new kernel)                      (~90-150 s)
# KVZIP_TREE: a snapshot of the checkout to run (default: the current directory)
set -uo pipefail
: "${OUT:?set OUT}"
mkdir -p "$OUT"
P=${KVZIP_TREE:-.}/packages
export PYTHONPATH=$P/kvzip-formats/src:$P/kvzip-kernels/src:$P/kvzip-kernels/tests:$P/kvzip-kernels/benchmarks
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
( time timeout ${TESTS_LIMIT_S:-150} python3 -m pytest -q -p no:cacheprovider \
    $P/kvzip-kernels/tests/test_write_compact.py -k "gpu or ties or rejects or quotient";
  timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu \
    $P/kvzip-kernels/tests/test_cache_write.py ) \
  2>&1 | tee $OUT/gpu_tests_cwrite.log | tail -8
timeout ${CW_LIMIT_S:-200} python3 $P/kvzip-kernels/benchmarks/bench_cache_write.py \
  --tag cwrite --out $OUT 2>&1 | tee $OUT/bench_cache_write_cwrite.log | tail -5
