#!/usr/bin/env bash
# One H200 session of kvzip inside vLLM 0.26, call by call (the machine keeps /tmp between
# back-to-back calls). From the checkout's root, with $OUT the folder that comes back:
#
#   gpu_session.sh install   # vLLM bundle part 2 (part 1 already in /tmp/vstage), the model's first piece
#   gpu_session.sh checks    # support matrix on 0.26, the CUDA decode kernels' tests (picks the decode path)
#   gpu_session.sh serving   # bench_serving.py: SERVING_FORMATS beside fp8, 3 runs each, 32k and 128k (SERVING_TAG=a, b: one folder per call)
#   gpu_session.sh e2e       # tests/test_vllm_gpu.py: the tier at 32k (E2E_TESTS=compact: the compact backend)
#   gpu_session.sh decode    # the kernels' paged-decode benchmark beside XQA (FlashInfer bundle carried)
#   gpu_session.sh tier      # tier_restore.py: the tier's GPU pipeline at 32k/128k (.carry/kv carried)
#   gpu_session.sh codec     # bench_lossless_gpu.py beside nvCOMP (.carry/kv, .carry/nvcomp carried)
#   gpu_session.sh faults    # tests/test_gpu_faults.py: damaged shared-prefix block, eviction race
#   gpu_session.sh store     # gpu_store.py: 4 x 128k back to back, 8 x 32k at once: every chunk stored, store GB/s while prefilling
#   gpu_session.sh quality   # SmolLM2 through vLLM 0.26 against kvzip eval, +r128 windows too (.carry/smollm2 carried)
#   gpu_session.sh window    # the residual window's GPU tests (then serving with SERVING_FORMATS=fp8,4bit,4bit+r128)
#   gpu_session.sh serve     # serve_h200.py: `vllm serve` with the tier and 4bit+r128 (.whl carried: serve_wheels.sh)
#   gpu_session.sh offload   # tier_vs_offload.py: the tier beside vLLM's OffloadingConnector, same CPU bytes and traffic (.carry/smollm2/p1 carried)
#   gpu_session.sh compacttier  # the tier core's CUDA paths and compact pages in the tier (test_cuda_pipeline, test_core, test_compact_tier)
#   gpu_session.sh scatter   # the CUDA pipeline's tests with both scatters, and core/scatter.py's (masked launch)
#   gpu_session.sh fixedcost # fixed_cost.py: a returning 6,000-token SmolLM2 prompt restored vs recomputed, call by call (.carry/smollm2 carried)
#   gpu_session.sh tp2       # nvidia-h200-x2: the tier and the compact backend at TP = 2 (not yet run)
#   gpu_session.sh tp2serving  # nvidia-h200-x2: bench_serving.py --tp 2, fp8 and 4bit at 32k (not yet run)
set -uo pipefail
stage=${1:?stage}
# KVZIP_TREE: a snapshot of the checkout to run (the working tree may be edited meanwhile)
R=${KVZIP_TREE:-$PWD}/packages
env_line() {
  export PYTHONPATH=/tmp/site:$R/kvzip-formats/src:$R/kvzip-kernels/src:$R/kvzip-lossless/src:$R/kvzip-vllm/src:$R/kvzip-eval/src
  # at most 8 files come back from $OUT: each stage's files go to one tarball ($OUT/$stage.tgz)
  RES=/tmp/res/$stage; mkdir -p $RES
  export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 KVZIP_RESULTS_DIR=$RES
  # the CUDA decode kernels serve vLLM only if their tests passed in this session
  export KVZIP_KERNELS_BACKEND=$(cat /tmp/kvzip_kernels_backend 2>/dev/null || echo triton)
}
case $stage in
install)
  P=${VLLM_PART2:-.carry/vllm-gpu/part2}
  cp $P/* /tmp/vstage/ && bash $P/install.sh /tmp/vstage /tmp/site >/tmp/envline 2>$OUT/install.log || exit 1
  mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p0 /tmp/smollm2/
  env_line
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
  ;;
checks)
  env_line
  timeout 120 python3 -m pytest -q $R/kvzip-vllm/tests/test_support.py 2>&1 | tee $RES/checks_support.log | tail -3
  # the test checks the dispatch itself: no override in its environment
  env -u KVZIP_KERNELS_BACKEND PYTHONPATH=$PYTHONPATH:$R/kvzip-kernels/tests timeout 200 python3 -m pytest -q -m gpu \
    $R/kvzip-kernels/tests/test_cuda_decode.py 2>&1 | tee $RES/checks_cuda_decode.log | tail -5
  if [ "${PIPESTATUS[0]}" = 0 ]; then echo auto >/tmp/kvzip_kernels_backend; else echo triton >/tmp/kvzip_kernels_backend; fi
  echo "decode path for vLLM: $(cat /tmp/kvzip_kernels_backend)"
  export KVZIP_KERNELS_BACKEND=$(cat /tmp/kvzip_kernels_backend)
  # CHECK_BACKEND_K: e.g. "backend_on_cuda and 3bit" (one format: about 80 s each)
  KVZIP_GPU_SHAPE=tiny timeout ${CHECK_BACKEND_LIMIT_S:-240} python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_vllm_e2e.py \
    -k "${CHECK_BACKEND_K:-backend_on_cuda}" -x 2>&1 | tee $RES/checks_backend_on_cuda.log | tail -4
  ;;
serving)
  env_line
  echo "KVZIP_KERNELS_BACKEND=$KVZIP_KERNELS_BACKEND"
  # Each call: fp8 first (its runs are the call's baseline), then the formats, one engine at a
  # time, each engine 3 rounds of a decode run at 32k and 128k, then 3 prefills at 32k.
  # An engine takes about 2 min (start 45-70 s, runs 50-70 s; the H200 logs of 2026-12-01):
  #   SERVING_TAG=a SERVING_FORMATS=fp8,4bit,3.5bit gpu_session.sh serving         # ~6.5 min
  #   SERVING_TAG=b SERVING_FORMATS=fp8,3bit,4bit+r128 gpu_session.sh serving      # ~7 min
  #   SERVING_TAG=c SERVING_FORMATS=fp8,3.5bit+r128,3bit+r128 gpu_session.sh serving  # optional
  # then: merge_serving.py --out results/vllm --name NAME a/bench_serving.json b/... (c/...)
  # A format starts only with 110 s of DEADLINE left; a stopped engine keeps its finished runs.
  S=$RES/${SERVING_TAG:-a}; mkdir -p $S
  python3 $R/kvzip-vllm/benchmarks/bench_serving.py --out $S --prefill-max-context 32768 \
    --formats ${SERVING_FORMATS:-fp8,4bit,3.5bit} --repeats ${SERVING_REPEATS:-3} \
    --deadline-s ${DEADLINE:-520} --stage-timeout-s ${SERVING_STAGE_S:-210} --min-stage-s 110 2>&1 \
    | tee $S/driver.log | grep -v "^| [a-z0-9.+]* | [0-9]* | [0-9] |" | tail -30
  ;;
e2e)
  env_line
  mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p1 .carry/smollm2/calibration /tmp/smollm2/ 2>/dev/null
  # measured on the H200 (2026-12-01): an 8B-shaped engine starts in about 45 s, and the tier
  # stores at about 0.025 GB/s, so the 32k tier scenario alone needs about 5 minutes; a test's
  # scenario log is written as it runs (a test stopped by its limit still leaves it)
  timeout ${E2E_LIMIT_S:-540} python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_vllm_gpu.py \
    -k "${E2E_TESTS:-tier}" 2>&1 | tee $RES/e2e_pytest.log | tail -6
  ;;
decode)
  env_line
  # the kernels' decode benchmark (FlashInfer bundle carried as .carry/flashinfer): CUDA and Triton beside XQA
  env -u KVZIP_KERNELS_BACKEND timeout ${DECODE_LIMIT_S:-300} python3 $R/kvzip-kernels/benchmarks/bench_paged_decode.py \
    --bundle .carry/flashinfer --formats ${DECODE_FORMATS:-fp8,int4,4bit} --backends ${DECODE_BACKENDS:-triton,cuda} \
    --shapes ${DECODE_SHAPES:-8b,70b-tp8} --batches ${DECODE_BATCHES:-8,32} --contexts 32768,131072 --tag ${DECODE_TAG:-v4a} \
    --time-budget-s ${DECODE_BUDGET_S:-260} --out $RES 2>&1 | tee $RES/decode.log | tail -30
  ;;
tier)
  env_line
  # the tier's GPU pipeline alone (no vLLM): 32k and 128k prefix restore against a pinned raw
  # copy, on the embedded model's KV (carried as .carry/kv: K.npy, V.npy)
  timeout ${TIER_LIMIT_S:-260} python3 $R/kvzip-vllm/benchmarks/tier_restore.py --kv-dir .carry/kv \
    --fit-tokens 1024 --out $RES/${TIER_NAME:-tier_restore_h200} --time-limit-s ${TIER_BUDGET_S:-200} 2>&1 | tee $RES/tier.log | tail -12
  ;;
codec)
  env_line
  # the GPU codec alone beside nvCOMP (wheels carried as .carry/nvcomp), same data
  timeout 150 python3 -m pytest -q -m gpu $R/kvzip-lossless/tests/test_batch.py $R/kvzip-lossless/tests/test_gpu.py \
    2>&1 | tee $RES/codec_gpu_tests.log | tail -4
  timeout ${CODEC_LIMIT_S:-200} python3 $R/kvzip-lossless/benchmarks/bench_lossless_gpu.py --kv .carry/kv \
    --nvcomp .carry/nvcomp --out $RES --name ${CODEC_NAME:-lossless_gpu_h200} 2>&1 | tee $RES/codec.log | tail -25
  ;;
faults)
  env_line
  timeout ${FAULTS_LIMIT_S:-540} python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_gpu_faults.py 2>&1 | tee $RES/faults_pytest.log | tail -4
  ;;
store)
  env_line
  # the tier's stores under load in vLLM (8B shape, vLLM's defaults): 4 prompts of 130048
  # tokens back to back, then 8 of 32768 at once; every whole chunk stored (spilled to the
  # host or waited for, never dropped), the last prompts restored, store GB/s while prefilling
  timeout ${STORE_LIMIT_S:-530} python3 $R/kvzip-vllm/benchmarks/gpu_store.py --out $RES \
    --name ${STORE_NAME:-gpu_store_h200} ${STORE_ARGS:-} 2>&1 | tee $RES/store.log | grep RESULT | cut -c1-1500
  ;;
quality)
  env_line
  # p0 came with install (a call carries at most 64 MiB): this call carries p1 and the calibration
  mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p1 .carry/smollm2/calibration /tmp/smollm2/ 2>/dev/null
  # QUALITY_FORMATS: NAME+rN (a residual window) is compared at decode positions, against kvzip
  # eval's measurement and the backend's served reading; 16 windows for more decode positions
  timeout 560 python3 $R/kvzip-vllm/benchmarks/vllm_quality.py --pieces /tmp/smollm2/p0 /tmp/smollm2/p1 \
    --calibration /tmp/smollm2/calibration --out $RES --deadline-s 420 \
    --formats ${QUALITY_FORMATS:-4bit,4bit+r128,3.5bit+r128,3bit+r128} --windows ${QUALITY_WINDOWS:-16} 2>&1 | tail -30
  ;;
fixedcost)
  env_line
  # the embedded SmolLM2's pieces (p0 came with install; this call carries p1 if not there yet)
  mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p1 /tmp/smollm2/ 2>/dev/null
  # two engines one after the other (tier, none): 10 documents of 6,000 tokens, 4 returns each
  # after a reset of vLLM's own prefix cache; every connector call timed (about 3-4 min)
  VLLM_USE_V2_MODEL_RUNNER=0 timeout ${FIXEDCOST_LIMIT_S:-420} python3 $R/kvzip-vllm/benchmarks/fixed_cost.py \
    --pieces /tmp/smollm2/p0 /tmp/smollm2/p1 --out $RES --name fixed_cost_h200 \
    --docs ${FIXEDCOST_DOCS:-10} --returns ${FIXEDCOST_RETURNS:-4} 2>&1 | tee $RES/fixedcost.log | tail -40
  ;;
window)
  env_line
  # the residual window's GPU paths (kernels' decode, FlashAttention workspace), no vLLM engine;
  # then SERVING_FORMATS=fp8,4bit,4bit+r128 gpu_session.sh serving for capacity and speed
  env -u KVZIP_KERNELS_BACKEND PYTHONPATH=$PYTHONPATH:$R/kvzip-kernels/tests timeout ${WINDOW_LIMIT_S:-240} \
    python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_window.py \
    $R/kvzip-kernels/tests/test_cuda_decode.py -k "window or sink" 2>&1 | tee $RES/window_gpu_tests.log | tail -4
  if [ "${PIPESTATUS[0]}" = 0 ]; then echo auto >/tmp/kvzip_kernels_backend; fi
  export KVZIP_KERNELS_BACKEND=$(cat /tmp/kvzip_kernels_backend 2>/dev/null || echo triton)
  echo "decode path for vLLM: $KVZIP_KERNELS_BACKEND"
  # the backend in vLLM with the window (tiny shape, beside fp8): capacity, graphs, its paths
  KVZIP_GPU_SHAPE=tiny timeout ${WINDOW_BACKEND_LIMIT_S:-240} python3 -m pytest -q -m gpu \
    "$R/kvzip-vllm/tests/test_vllm_e2e.py::test_backend_on_cuda_capacity_graphs_and_kernel_paths[4bit+r128]" \
    2>&1 | tee $RES/window_backend_on_cuda.log | tail -4
  ;;
serve)
  env_line
  # the API server's packages that the bundle lacks (serve_wheels.sh puts them in .whl/)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -3
  # the tokenizer comes from the embedded model's first piece (install copied it; else carry it)
  [ -f /tmp/smollm2/p0/manifest.json ] || { mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p0 /tmp/smollm2/; }
  # two servers (tier; 4bit+r128 on KVZIP_KERNELS_BACKEND's decode), CUDA graphs (vLLM's default)
  timeout ${SERVE_LIMIT_S:-470} python3 $R/kvzip-vllm/benchmarks/serve_h200.py --out $RES \
    --smollm2-piece /tmp/smollm2/p0 --deadline-s ${SERVE_DEADLINE_S:-430} ${SERVE_ARGS:-} 2>&1 \
    | tee $RES/serve_driver.log | tail -30
  ;;
offload)
  env_line
  # kvzip's tier beside vLLM's OffloadingConnector (what --kv-offloading-size gives) and no
  # connector, the same CPU bytes and traffic, one engine per process: the 8B shape (dummy
  # weights) and the embedded SmolLM2 (p0 came with install; this call carries p1)
  mkdir -p /tmp/smollm2 && cp -r .carry/smollm2/p1 /tmp/smollm2/ 2>/dev/null
  [ -f /tmp/smollm2/p0/manifest.json ] || cp -r .carry/smollm2/p0 /tmp/smollm2/ 2>/dev/null
  models=${OFFLOAD_MODELS:-8b,smollm2}
  pieces="--smollm2-pieces /tmp/smollm2/p0 /tmp/smollm2/p1"
  if [ ! -f /tmp/smollm2/p0/manifest.json ] || [ ! -f /tmp/smollm2/p1/manifest.json ]; then
    models=$(echo "$models" | tr , '\n' | grep -vx smollm2 | paste -sd,); pieces=""
    echo "SmolLM2's pieces are not here: models $models"
  fi
  # engines start until OFFLOAD_DEADLINE_S; the files are written by it + 20 s
  timeout ${OFFLOAD_LIMIT_S:-530} python3 $R/kvzip-vllm/benchmarks/tier_vs_offload.py --out $RES \
    --name ${OFFLOAD_NAME:-tier_vs_offload_h200} --models $models $pieces \
    --deadline-s ${OFFLOAD_DEADLINE_S:-490} ${OFFLOAD_ARGS:-} 2>&1 | tee $RES/offload.log | tail -45
  ;;
scatter)
  env_line
  PYTHONPATH=$PYTHONPATH:$R/kvzip-vllm/tests timeout 240 python3 -m pytest -q -m gpu \
    $R/kvzip-vllm/tests/test_cuda_pipeline.py $R/kvzip-vllm/tests/test_scatter.py 2>&1 \
    | tee $RES/scatter_tests.log | tail -4
  ;;
compacttier)
  env_line
  # the tier core's CUDA pipeline (its gather/scatter now through core/pages.py), the core's
  # unit tests, then the tier with int4 and 4bit pages in vLLM 0.26 (tiny dummy-weight Llama)
  timeout 200 python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_cuda_pipeline.py 2>&1 \
    | tee $RES/cuda_pipeline.log | tail -3
  timeout 120 python3 -m pytest -q $R/kvzip-vllm/tests/test_core.py 2>&1 | tee $RES/core.log | tail -3
  timeout 400 python3 -m pytest -q -m gpu $R/kvzip-vllm/tests/test_compact_tier.py 2>&1 \
    | tee $RES/compact_tier.log | tail -5
  ;;
tp2)
  env_line
  # nvidia-h200-x2 only: the tier and the compact backend at tensor_parallel_size 2 (NVLink
  # multicast stays off, also in the processes vLLM starts), then capacity and decode at 32k
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  mkdir -p /tmp/smollm2
  timeout ${TP_TIER_LIMIT_S:-420} python3 $R/kvzip-vllm/benchmarks/gpu_e2e.py tier --tp 2 --out $RES 2>&1 \
    | tee $RES/tp2_tier.log | grep RESULT | cut -c1-600
  timeout 200 python3 $R/kvzip-vllm/benchmarks/gpu_e2e.py compact --tp 2 --format 4bit --out $RES 2>&1 \
    | tee $RES/tp2_compact.log | grep RESULT | cut -c1-600
  ;;
tp2serving)
  env_line
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 $R/kvzip-vllm/benchmarks/bench_serving.py --out $RES --tp 2 --formats fp8,4bit \
    --contexts 32768 --deadline-s ${DEADLINE:-540} --stage-timeout-s 240 2>&1 | tail -12
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
[ -n "${RES:-}" ] && tar czf $OUT/$stage.tgz -C /tmp/res $stage && ls -la $RES | tail -n +2 | awk '{print $5, $9}'
