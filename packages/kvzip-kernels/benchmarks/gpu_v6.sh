#!/usr/bin/env bash
# One H200 call for kvzip-kernels' research design v6 beside v5 (issue 27; NOTES.md "v6"), from
# the checkout's root, FlashInfer bundle carried as .carry/flashinfer, results under $OUT
# (at most ~8 minutes in all):
#   1. the gpu-marked tests of the CUDA decode kernel: v5 against the reference and Triton,
#      v6 (full grid) and v6s3 (part) against the reference and v5, sinks, window (<= 220 s)
#   2. bench_paged_decode.py over the full grid (8B and 70B-TP8, batch 8/16/32/64, 32k/128k):
#      XQA and FlashInfer tensor-core fp8 and the CUDA kernel's designs v5, v6 (2 ring stages
#      of 32 tokens per warp) and v6s3 (3 stages) for int4/4bit/3.5bit/3bit, in one process
#      on the same data; v6 outputs checked against v5's ("checks" in the JSON)
#      (its own time budget 200 s, 10 timings per kernel)                        (<= 250 s)
# Files: gpu_tests_v6.log, bench_paged_decode_v6.{json,md,log}.
# KVZIP_TREE: a snapshot of the checkout to run (default: the current directory); BUNDLE: the
# FlashInfer bundle (default .carry/flashinfer, relative to the current directory)
set -uo pipefail
: "${OUT:?set OUT}"
P=${KVZIP_TREE:-.}/packages
BUNDLE=${BUNDLE:-.carry/flashinfer}
export PYTHONPATH=$P/kvzip-formats/src:$P/kvzip-kernels/src:$P/kvzip-kernels/tests:$P/kvzip-kernels/benchmarks
export PYTHONUNBUFFERED=1
unset KVZIP_KERNELS_BACKEND
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
( time timeout ${TESTS_LIMIT_S:-220} python3 -m pytest -q -m gpu \
    $P/kvzip-kernels/tests/test_cuda_decode.py ) 2>&1 | tee $OUT/gpu_tests_v6.log | tail -8
timeout ${BENCH_LIMIT_S:-250} python3 $P/kvzip-kernels/benchmarks/bench_paged_decode.py \
  --bundle $BUNDLE --formats fp8,int4,4bit,3.5bit,3bit --backends cuda \
  --cuda-variants ${VARIANTS:-v5,v6,v6s3} \
  --shapes 8b,70b-tp8 --batches 8,16,32,64 --contexts 32768,131072 \
  --iters ${ITERS:-10} --warmup 3 --time-budget-s ${BUDGET_S:-200} --tag v6 --out $OUT \
  2>&1 | tee $OUT/bench_paged_decode_v6.log | grep -v "^\[check\]" | tail -60
grep "^\[check\]" $OUT/bench_paged_decode_v6.log | sort -t: -k2 -g | tail -3
