#!/usr/bin/env bash
# One GPU session of kvzip inside vLLM 0.26 (the H200 bundle), call by call (the machine keeps
# /tmp between back-to-back calls): the GPU tests and `kvzip bench`. From the checkout's root,
# with $OUT the folder that comes back (each stage's files in $OUT/$stage.tgz):
#
#   gpu_session.sh install   # vLLM bundle part 2 (part 1 already in /tmp/vstage), the embedded model's first piece
#   gpu_session.sh checks    # support matrix, the CUDA decode kernels' tests (picks the decode path), the backend in vLLM
#   gpu_session.sh serving   # kvzip bench serving: SERVING_FORMATS beside fp8, 3 runs, 32k and 128k (SERVING_MERGE: earlier calls)
#   gpu_session.sh tier      # kvzip bench tier: the tier beside vLLM's OffloadingConnector and recompute (TIER_WORKLOADS)
#   gpu_session.sh tierdecode  # kvzip bench tier-decode: decoders' ITL while long prompts return, the store path's waits
#   gpu_session.sh serve     # kvzip bench serve: `vllm serve` with vLLM's defaults per connector (kvzip, offload, none), the same `vllm bench serve` (SERVE_ARGS)
#   gpu_session.sh kernels   # kvzip bench kernels: the paged decode beside XQA / FlashInfer / vLLM's FA3 fp8 (.carry/flashinfer if carried; KERNELS_VARIANTS=v6,v7,v7s4: the CUDA designs; default auto, each format's shipped one)
#   gpu_session.sh v7        # the CUDA decode's research designs' GPU tests (v7, v7s4 against the reference and v6)
#   gpu_session.sh restore   # kvzip bench restore: the tier core's restore beside a raw copy, no vLLM (RESTORE_ARGS)
#   gpu_session.sh e2e       # tests/test_vllm_gpu.py: the tier at 32k (E2E_TESTS=compact: the compact backend)
#   gpu_session.sh faults    # tests/test_gpu_faults.py: damaged shared-prefix block, eviction race, pending loads
#   gpu_session.sh quality   # tests/test_vllm_quality_gpu.py: SmolLM2 through vLLM against kvzip eval (.carry/smollm2 carried)
#   gpu_session.sh codec     # the GPU codec's tests
#   gpu_session.sh window    # the residual window's GPU tests
#   gpu_session.sh tiercore  # the tier core's CUDA pipeline and scatter GPU tests (compacttier's first half)
#   gpu_session.sh compacttier  # the tier core's CUDA pipeline, both scatters, compact pages in the tier
#
# kernels, v7, restore (and the fp8 design's benchmarks/fp8mma/gpu.sh) need no vLLM: they run on
# the machine's own torch in the call that carries bundle part 1, with the wheels of click and
# tqdm on PYTHONPATH (not pytest: the machine's is newer and a carried one shadows it).
set -uo pipefail
stage=${1:?stage}
# KVZIP_TREE: a snapshot of the checkout to run (the working tree may be edited meanwhile)
R=${KVZIP_TREE:-$PWD}/packages
env_line() {
  export PYTHONPATH=/tmp/site:$R/kvzip-formats/src:$R/kvzip-kernels/src:$R/kvzip-lossless/src:$R/kvzip-vllm/src:$R/kvzip-eval/src
  RES=/tmp/res/$stage; mkdir -p $RES
  export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 KVZIP_RESULTS_DIR=$RES
  # the CUDA decode kernels serve vLLM only if their tests passed in this session
  export KVZIP_KERNELS_BACKEND=$(cat /tmp/kvzip_kernels_backend 2>/dev/null || echo triton)
}
bench() { python3 -m kvzip_eval bench "$@"; }
# BENCH_MODEL=smollm2: `kvzip bench serving|tier` on the embedded SmolLM2 (real weights; its
# pieces carried as .carry/smollm2/p0, p1, unpacked once) instead of the 8B shape
model_args() {
  [ "${BENCH_MODEL:-}" = smollm2 ] || return 0
  mkdir -p /tmp/smollm2 && cp -rn .carry/smollm2/p0 .carry/smollm2/p1 /tmp/smollm2/ 2>/dev/null
  [ -f /tmp/smollm2/hf/config.json ] || python3 $R/kvzip-vllm/benchmarks/carry_model.py unpack \
    --out /tmp/smollm2/hf /tmp/smollm2/p0 /tmp/smollm2/p1 >&2
  echo "--model /tmp/smollm2/hf"
}
case $stage in
install)
  P=${VLLM_PART2:-.carry/vllm-gpu/part2}
  cp $P/* /tmp/vstage/ && bash $P/install.sh /tmp/vstage /tmp/site >/tmp/envline 2>$OUT/install.log || exit 1
  mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p0 /tmp/smollm2/ 2>/dev/null
  env_line
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
  ;;
checks)
  env_line
  timeout 120 python3 -m pytest -q $R/kvzip-vllm/tests/test_support.py 2>&1 | tee $RES/checks_support.log | tail -3
  # the test checks the dispatch itself: no override in its environment
  # (the shipped design's tests pick the path; the research designs' tests are the v7 stage's)
  env -u KVZIP_KERNELS_BACKEND PYTHONPATH=$PYTHONPATH:$R/kvzip-kernels/tests timeout 200 python3 -m pytest -q -m gpu \
    $R/kvzip-kernels/tests/test_cuda_decode.py -k "not v7" 2>&1 | tee $RES/checks_cuda_decode.log | tail -5
  if [ "${PIPESTATUS[0]}" = 0 ]; then echo auto >/tmp/kvzip_kernels_backend; else echo triton >/tmp/kvzip_kernels_backend; fi
  echo "decode path for vLLM: $(cat /tmp/kvzip_kernels_backend)"
  export KVZIP_KERNELS_BACKEND=$(cat /tmp/kvzip_kernels_backend)
  KVZIP_GPU_SHAPE=tiny timeout ${CHECK_BACKEND_LIMIT_S:-240} python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_vllm_e2e.py \
    -k "${CHECK_BACKEND_K:-backend_on_cuda}" -x 2>&1 | tee $RES/checks_backend_on_cuda.log | tail -4
  ;;
serving)
  env_line
  # An 8B engine takes about 2 min (start 45-70 s, then 3 runs at 32k and 128k): three formats
  # fit one call. Split the formats over calls, fp8 first in each (its runs are that call's
  # baseline), the later calls merging the earlier ones' results:
  #   SERVING_FORMATS=fp8,4bit,3.5bit gpu_session.sh serving
  #   SERVING_FORMATS=fp8,3bit,4bit+r128 SERVING_MERGE=/tmp/res/serving/bench_serving.json gpu_session.sh serving
  merge=""; [ -n "${SERVING_MERGE:-}" ] && cp $SERVING_MERGE /tmp/serving_prev.json && merge="--merge /tmp/serving_prev.json"
  bench serving --out $RES $(model_args) --formats ${SERVING_FORMATS:-fp8,4bit,3.5bit} --contexts ${SERVING_CONTEXTS:-32768,131072} \
    --runs ${SERVING_RUNS:-3} --prefill-max-context 32768 --deadline-s ${DEADLINE:-520} --min-engine-s 110 \
    --engine-timeout-s ${SERVING_ENGINE_S:-210} $merge ${SERVING_ARGS:-} 2>&1 | tee $RES/serving.log | tail -30
  ;;
tier)
  env_line
  # the tier beside vLLM's OffloadingConnector (what --kv-offloading-size gives) and recompute,
  # the same CPU bytes, one engine per process, on the 8B shape (dummy weights; BENCH_MODEL=
  # smollm2 with TIER_CONTEXTS=8192: the embedded model); a workload a call (restore: both
  # tiers hold the prompts; capacity: 1.3x what a raw tier holds)
  bench tier --out $RES/${TIER_WORKLOADS:-restore} $(model_args) --workloads ${TIER_WORKLOADS:-restore} --contexts ${TIER_CONTEXTS:-8192,32768,131072} \
    --deadline-s ${DEADLINE:-500} ${TIER_ARGS:-} 2>&1 | tee $RES/tier.log | tail -30
  ;;
tierdecode)
  env_line
  bench tier-decode --out $RES $(model_args) --deadline-s ${DEADLINE:-540} ${DECODE_ARGS:-} 2>&1 | tee $RES/tier_decode.log | tail -30
  ;;
serve)
  env_line
  # the bundle has no API server: its missing wheels travel as .whl (carried with the tree;
  # made here by benchmarks/serve_wheels.sh)
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  fi
  # `vllm serve` per connector (kvzip checked, OffloadingConnector, none; about 60-90 s each to
  # start), each with the same `vllm bench serve` twice; servers and benches run as `python3 -m
  # vllm.entrypoints.cli.main` (no `vllm` script under /tmp/site) with this PYTHONPATH
  # (the three servers of one comparison over two calls: SERVE_ARGS="--connectors kvzip", then
  # SERVE_ARGS="--connectors offload,none" SERVE_MERGE=/tmp/res/serve/serve_tier_defaults.json)
  merge=""; [ -n "${SERVE_MERGE:-}" ] && cp $SERVE_MERGE /tmp/serve_prev.json && merge="--merge /tmp/serve_prev.json"
  # (SERVE_RESET: vLLM's own prefix cache emptied before the later passes, so that they come
  # from the tiers: the default workload's prefixes fit vLLM's GPU cache; SERVE_RESET= : not)
  timeout ${SERVE_LIMIT_S:-570} python3 -m kvzip_eval bench serve --out $RES --deadline-s ${DEADLINE:-480} \
    $merge ${SERVE_RESET---reset-prefix-cache} ${SERVE_ARGS:-} 2>&1 | tee $RES/serve.log | tail -30
  ;;
kernels)
  env_line
  fi=""; [ -d .carry/flashinfer ] && fi="--flashinfer-bundle .carry/flashinfer"
  env -u KVZIP_KERNELS_BACKEND timeout ${KERNELS_LIMIT_S:-560} python3 -m kvzip_eval bench kernels --out $RES $fi \
    --formats ${KERNELS_FORMATS:-fp8,int4,4bit,3.5bit,3bit} --shapes ${KERNELS_SHAPES:-8b,70b-tp8} \
    --batches ${KERNELS_BATCHES:-8,32} --cuda-variants ${KERNELS_VARIANTS:-auto} --time-budget-s ${KERNELS_BUDGET_S:-480} \
    --timing ${KERNELS_TIMING:-eager} \
    2>&1 | tee $RES/kernels.log | tail -30
  ;;
v7)
  env_line
  # the CUDA decode's research designs (kvzip-kernels NOTES "v7") against the reference and v6
  PYTHONPATH=$PYTHONPATH:$R/kvzip-kernels/tests timeout ${V7_LIMIT_S:-300} python3 -m pytest -q -m gpu \
    $R/kvzip-kernels/tests/test_cuda_decode.py -k "v7" 2>&1 | tee $RES/gpu_tests_v7.log | tail -5
  ;;
restore)
  env_line
  timeout ${RESTORE_LIMIT_S:-300} python3 -m kvzip_eval bench restore --shape 8b --out $RES ${RESTORE_ARGS:-} \
    2>&1 | tee $RES/restore.log | tail -8
  ;;
e2e)
  env_line
  timeout ${E2E_LIMIT_S:-540} python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_vllm_gpu.py \
    -k "${E2E_TESTS:-tier}" 2>&1 | tee $RES/e2e_pytest.log | tail -6
  ;;
faults)
  env_line
  timeout ${FAULTS_LIMIT_S:-540} python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_gpu_faults.py 2>&1 | tee $RES/faults_pytest.log | tail -4
  ;;
quality)
  env_line
  # p0 came with install (a call carries at most 64 MiB): this call carries p1 and the calibration
  mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p1 .carry/smollm2/calibration /tmp/smollm2/ 2>/dev/null
  KVZIP_SMOLLM2=/tmp/smollm2/p0,/tmp/smollm2/p1 KVZIP_SMOLLM2_CALIBRATION=/tmp/smollm2/calibration \
    timeout 560 python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_vllm_quality_gpu.py 2>&1 | tee $RES/quality.log | tail -6
  ;;
codec)
  env_line
  timeout 150 python3 -m pytest -q -m gpu $R/kvzip-lossless/tests/test_batch.py $R/kvzip-lossless/tests/test_gpu.py \
    2>&1 | tee $RES/codec_gpu_tests.log | tail -4
  ;;
window)
  env_line
  env -u KVZIP_KERNELS_BACKEND PYTHONPATH=$PYTHONPATH:$R/kvzip-kernels/tests timeout ${WINDOW_LIMIT_S:-240} \
    python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_window.py \
    $R/kvzip-kernels/tests/test_cuda_decode.py -k "window or sink" 2>&1 | tee $RES/window_gpu_tests.log | tail -4
  ;;
tiercore|compacttier)
  env_line
  PYTHONPATH=$PYTHONPATH:$R/kvzip-vllm/tests timeout 300 python3 -m pytest -q -m gpu \
    $R/kvzip-vllm/tests/test_cuda_pipeline.py $R/kvzip-vllm/tests/test_scatter.py 2>&1 | tee $RES/tier_core.log | tail -4
  [ "$stage" = tiercore ] || timeout 400 python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_compact_tier.py 2>&1 | tee $RES/compact_tier.log | tail -5
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
[ -n "${RES:-}" ] && tar czf $OUT/$stage.tgz -C /tmp/res $stage && ls -la $RES | tail -n +2 | awk '{print $5, $9}'
