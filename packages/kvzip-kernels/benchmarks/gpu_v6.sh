#!/usr/bin/env bash
# One H200 call for kvzip-kernels' CUDA decode kernel, design v6 (issue 27; NOTES.md "v6"), from
# the checkout's root, FlashInfer bundle carried as .carry/flashinfer, results under $OUT
# (at most ~8 minutes in all):
#   1. the gpu-marked tests of the CUDA decode kernel: against the float32 reference and the
#      Triton kernels, sinks, window, odd unit counts, block-strided caches      (<= 220 s)
#   2. bench_paged_decode.py over a grid (default the full one: 8B and 70B-TP8, batch
#      8/16/32/64, 32k/128k; SHAPES, BATCHES, CONTEXTS narrow it): XQA and FlashInfer
#      tensor-core fp8 and the CUDA kernel (keys cuda-v6-<fmt>) for int4/4bit/3.5bit/3bit, in
#      one process on the same data (its own time budget 200 s, 10 timings per kernel)
#                                                                                (<= 250 s)
# Files: gpu_tests_$TAG.log, bench_paged_decode_$TAG.{json,md,log} (TAG default v6). TESTS=0
# skips step 1; BENCH_ARGS adds arguments to the benchmark (e.g. "--legacy-splits --graphs":
# the split count of the rule before split sizing by rounds, and graph-replayed calls).
# KVZIP_TREE: a snapshot of the checkout to run (default: the current directory); BUNDLE: the
# FlashInfer bundle (default .carry/flashinfer, relative to the current directory)
set -uo pipefail
: "${OUT:?set OUT}"
P=${KVZIP_TREE:-.}/packages
BUNDLE=${BUNDLE:-.carry/flashinfer}
TAG=${TAG:-v6}
export PYTHONPATH=$P/kvzip-formats/src:$P/kvzip-kernels/src:$P/kvzip-kernels/tests:$P/kvzip-kernels/benchmarks
export PYTHONUNBUFFERED=1
unset KVZIP_KERNELS_BACKEND
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "${TESTS:-1}" != 0 ]; then
  ( time timeout ${TESTS_LIMIT_S:-220} python3 -m pytest -q -m gpu \
      $P/kvzip-kernels/tests/test_cuda_decode.py ) 2>&1 | tee $OUT/gpu_tests_$TAG.log | tail -8
fi
timeout ${BENCH_LIMIT_S:-250} python3 $P/kvzip-kernels/benchmarks/bench_paged_decode.py \
  --bundle $BUNDLE --formats fp8,int4,4bit,3.5bit,3bit --backends cuda \
  --shapes ${SHAPES:-8b,70b-tp8} --batches ${BATCHES:-8,16,32,64} \
  --contexts ${CONTEXTS:-32768,131072} \
  --iters ${ITERS:-10} --warmup 3 --time-budget-s ${BUDGET_S:-200} --tag $TAG --out $OUT \
  ${BENCH_ARGS:-} \
  2>&1 | tee $OUT/bench_paged_decode_$TAG.log | tail -60
