"""CPU time of one forward of 1,024 tokens through the band attention against sdpa (one torch
thread): ``python band_cost.py`` for the five cases, ``python band_cost.py --mallopt`` for the
two band cases with glibc's mmap threshold at 1 GiB and trim threshold at 2 GiB."""

import ctypes
import resource
import sys
import time

import torch

from kvzip_eval.calibrate.shipped import shipped_calibration
from kvzip_eval.corpus import token_windows
from kvzip_eval.model import load_model
from kvzip_eval.quality import window
from kvzip_eval.quality.kl import final_hidden
from kvzip_formats import get_format

torch.set_num_threads(1)
loaded = load_model()
fmt = get_format("4bit", calibration=shipped_calibration(loaded.info.identity))
ids = token_windows(loaded.tokenizer, 1, 1024, seed=0)[:1]


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def run(label, f, band):
    with torch.no_grad(), window.band_mode(loaded.model, band):
        final_hidden(loaded, ids, f)  # warm
        u0, s0 = cpu()
        t0 = time.perf_counter()
        for _ in range(2):
            final_hidden(loaded, ids, f)
        u1, s1 = cpu()
    wall = (time.perf_counter() - t0) / 2
    print(
        f"{label}: user {(u1 - u0) / 2:.2f} s sys {(s1 - s0) / 2:.2f} s wall {wall:.2f} s "
        "per forward",
        flush=True,
    )


if "--mallopt" in sys.argv:
    libc = ctypes.CDLL("libc.so.6")
    print("mallopt", libc.mallopt(-3, 1 << 30), libc.mallopt(-1, 1 << 31))
    run("bf16 band", None, True)
    run("4bit+r128 band", window.Windowed(fmt, 128), True)
else:
    run("bf16 sdpa", None, False)
    run("bf16 band", None, True)
    run("4bit sdpa", fmt, False)
    run("4bit band", fmt, True)
    run("4bit+r128 band", window.Windowed(fmt, 128), True)
