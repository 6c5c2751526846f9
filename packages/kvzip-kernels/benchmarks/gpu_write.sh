#!/usr/bin/env bash
# One H200 call for the compact formats' cache-write (issue 27 item 5), from the checkout's
# root, results under $OUT (about 2-3 minutes, at most 5 by the timeouts):
#   1. the shipped write's tests on the GPU (their interpreter twins run on the CPU):
#      tests/test_cache_write.py's gpu cases (int4 / fp8 bit-exact at 4,099 tokens x 8 heads;
#      3bit at head_dim 64; every compact format at the 8B shape as kvzip-vllm calls it,
#      bf16 / fp16 / fp32 x, against the quantizer of the kernel's own y) and
#      tests/test_write_compact.py's ties / zero-row / bias and rejected-row cases compiled,
#      and its emulation of the GPU quotient                                     (~60-100 s)
#   2. bench_cache_write.py: fp8, int4 and the compact formats' shipped write (cache_write,
#      as the backend calls it; K and V also apart) against a prefill layer of the same
#      tokens, 2k/8k/32k tokens, vLLM's slot pattern and random slots       (~60-90 s)
# (the run that chose the kernel, with the split and fused writes beside it:
#  results/kernels/bench_cache_write_cwrite.md; `--write-paths shipped,fused,compact` repeats
#  that comparison without the split path, which left the package)
# KVZIP_TREE: a snapshot of the checkout to run (default: the current directory)
set -uo pipefail
: "${OUT:?set OUT}"
mkdir -p "$OUT"
P=${KVZIP_TREE:-.}/packages
export PYTHONPATH=$P/kvzip-formats/src:$P/kvzip-kernels/src:$P/kvzip-kernels/tests:$P/kvzip-kernels/benchmarks
export PYTHONUNBUFFERED=1
TAG=${TAG:-ship}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
( time timeout ${TESTS_LIMIT_S:-170} python3 -m pytest -q -p no:cacheprovider \
    $P/kvzip-kernels/tests/test_cache_write.py $P/kvzip-kernels/tests/test_write_compact.py \
    -k "gpu or ties or rejects" ) 2>&1 | tee $OUT/gpu_tests_$TAG.log | tail -8
timeout ${CW_LIMIT_S:-130} python3 $P/kvzip-kernels/benchmarks/bench_cache_write.py \
  --tag $TAG --out $OUT 2>&1 | tee $OUT/bench_cache_write_$TAG.log | tail -5
