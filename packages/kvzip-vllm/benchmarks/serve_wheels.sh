#!/usr/bin/env bash
# The API server's Python packages that the H200 image and the vLLM 0.26 bundle
# lack, downloaded as Python 3.12 wheels into .whl/ (a folder
# that .git/info/exclude ignores; carry it). Run here, from the checkout's root:
#
#   bash packages/kvzip-vllm/benchmarks/serve_wheels.sh
#
# Which: `vllm serve` in 0.26.0 imports at start-up uvicorn (entrypoints/launcher.py),
# prometheus_fastapi_instrumentator (serve/instrumentator/metrics.py) and
# model_hosting_container_standards (serve/sagemaker/api_router.py, imported by
# openai/api_server.py), which imports jmespath; python-multipart is what FastAPI needs for any
# form route (starlette only tries it; carried so that no route definition can stop the start);
# watchfiles is what uvicorn's reload support imports at `vllm serve` start-up in 0.26.0 (the
# H200 run of 2026-12-02 stopped on its absence: the one binary wheel here, cp312 manylinux).
# Found by importing 0.26.0's api_server, its routers and `vllm bench serve`'s modules with an
# import hook that names every package loaded and who loaded it; everything else they load is
# in the image or the bundle (aiohttp, h11, click, prometheus-client, uvloop, fastapi, ...).
# Versions: what `uv pip compile --exclude-newer 2026-07-31` resolves for vLLM 0.26.0's
# requirements (its release date).
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
#   --upgrade --target /tmp/site .whl/*.whl   (gpu_session.sh serve does it).
set -euo pipefail
EXCLUDE=$(git rev-parse --git-path info/exclude)  # a worktree's is the main checkout's
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo /.whl/ >>"$EXCLUDE"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl \
  uvicorn==0.52.0 \
  prometheus-fastapi-instrumentator==8.1.0 \
  model-hosting-container-standards==0.1.16 \
  jmespath==1.1.0 \
  python-multipart==0.0.32 \
  watchfiles==1.1.1
ls -l .whl
