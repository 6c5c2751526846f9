#!/usr/bin/env bash
# One H200 call for kvzip-kernels (issue 18's v5 run, which also timed design v4a: commit
# 0e753f7 and before), from the checkout's root, FlashInfer bundle carried as
# .carry/flashinfer, results under $OUT (at most ~9 minutes in all):
#   1. the gpu-marked tests of the CUDA decode kernel (every format) and the research fused
#      cache-write's tests (benchmarks/test_write_fused.py) on the GPU            (<= 180 s)
#   2. bench_paged_decode.py over the full grid (8B and 70B-TP8, batch 8/16/32/64, 32k/128k):
#      XQA and FlashInfer tensor-core fp8, our Triton kernels for fp8/int4/4bit/3.5bit/3bit,
#      and cuda-v5-* for int4/4bit/3.5bit/3bit, in one process on the same data
#      (its own time budget 230 s, 10 timings per kernel)                       (<= 290 s)
#   3. bench_cache_write.py: split (shipped) and fused (research) compact writes vs a
#      prefill layer                                                               (<= 70 s)
# KVZIP_TREE: a snapshot of the checkout to run (default: the current directory); BUNDLE: the
# FlashInfer bundle (default .carry/flashinfer, relative to the current directory)
set -uo pipefail
: "${OUT:?set OUT}"
P=${KVZIP_TREE:-.}/packages
BUNDLE=${BUNDLE:-.carry/flashinfer}
export PYTHONPATH=$P/kvzip-formats/src:$P/kvzip-kernels/src:$P/kvzip-kernels/tests:$P/kvzip-kernels/benchmarks
export PYTHONUNBUFFERED=1
unset KVZIP_KERNELS_BACKEND
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader  # 7 files come back: logs, JSON, md
( time timeout ${TESTS_LIMIT_S:-180} python3 -m pytest -q -m gpu \
    $P/kvzip-kernels/tests/test_cuda_decode.py;
  timeout 60 python3 -m pytest -q $P/kvzip-kernels/benchmarks/test_write_fused.py ) \
  2>&1 | tee $OUT/gpu_tests_v5.log | tail -8
timeout ${BENCH_LIMIT_S:-290} python3 $P/kvzip-kernels/benchmarks/bench_paged_decode.py \
  --bundle $BUNDLE --formats fp8,int4,4bit,3.5bit,3bit --backends triton,cuda \
  --shapes 8b,70b-tp8 --batches 8,16,32,64 --contexts 32768,131072 \
  --iters ${ITERS:-10} --warmup 3 --time-budget-s ${BUDGET_S:-230} --tag v5 --out $OUT \
  2>&1 | tee $OUT/bench_paged_decode_v5.log | grep -v "^\[check\]" | tail -45
timeout ${CW_LIMIT_S:-70} python3 $P/kvzip-kernels/benchmarks/bench_cache_write.py \
  --tag fused --out $OUT 2>&1 | tee $OUT/bench_cache_write_fused.log | tail -22
