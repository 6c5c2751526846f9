r"""What the tier's chunk size (``chunk_tokens``) does to the stored bytes, on real KV.

    python packages/kvzip-vllm/benchmarks/tier_chunk_sizes.py --kv-dir .carry/tier_kv \
        --out results/vllm/tier_chunk_sizes

The KV dump (``tier_restore.py --dump``: the embedded model's K and V, uint16 bf16 bits
``[layer, token, head, dim]``) is cut into chunks of each size after its first 2,048 tokens,
every layer's K and V of a chunk coded by ``kvzip_lossless.encode_batch`` with a table set
fitted on those first 2,048 tokens (never coded), each blob decoded again and compared bit for
bit. Per size: the ratio of the stored bytes (blobs, plus the plans the tier keeps beside
them and the arena's rounding of each record), and the tokens a prompt loses on average to the
chunk boundary (a prefix is reused in whole chunks: about half a chunk).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

import kvzip_lossless
from kvzip_vllm.store import RECORD_ALIGN

FIT = 2048
SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("results/vllm/tier_chunk_sizes"))
    args = ap.parse_args(argv)
    k, v = (np.load(args.kv_dir / f"{x}.npy") for x in "KV")
    L, T = k.shape[:2]
    kv = [
        tuple(torch.from_numpy(a[layer].view(np.int16).copy()).view(torch.bfloat16) for a in (k, v))
        for layer in range(L)
    ]
    tables = kvzip_lossless.build_kv_tables([[(x[:FIT], y[:FIT]) for x, y in kv]])
    usable = T - FIT
    rows = []
    for size in SIZES:
        n = usable // size
        if n == 0:
            continue
        raw = blob = held = 0
        for c in range(n):
            a = FIT + c * size
            tensors, slots = [], []
            for layer, (x, y) in enumerate(kv):
                tensors += [x[a : a + size].contiguous(), y[a : a + size].contiguous()]
                slots += [kvzip_lossless.kv_slot(layer, "k"), kvzip_lossless.kv_slot(layer, "v")]
            enc = kvzip_lossless.encode_batch(tensors, tables=tables, slots=slots)
            out, bad = kvzip_lossless.decode_batch(enc.data, enc.offsets, enc.plans, tables=tables)
            want = torch.cat([t.reshape(-1) for t in tensors]).view(torch.int16)
            if bad.any() or not torch.equal(out.reshape(-1).view(torch.int16), want):
                raise SystemExit(f"chunk size {size}, chunk {c}: not restored bit for bit")
            raw += sum(t.numel() * 2 for t in tensors)
            blob += enc.nbytes
            held += -(-enc.nbytes // RECORD_ALIGN) * RECORD_ALIGN + enc.plans.nbytes
        rows.append(
            {
                "chunk_tokens": size,
                "chunks": n,
                "blobs_per_chunk": 2 * L,
                "ratio_blobs": round(raw / blob, 4),
                "ratio_held": round(raw / held, 4),
                "mean_tokens_lost_at_the_boundary": (size - 1) / 2,
            }
        )
        print(rows[-1], flush=True)
    src = (
        json.loads((args.kv_dir / "source.json").read_text())
        if (args.kv_dir / "source.json").exists()
        else {}
    )
    result = {
        "what": "tier stored bytes per chunk size (encode_batch + decode_batch, bit-exact)",
        "device": platform.processor() or platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "kvzip_lossless": kvzip_lossless.__version__,
        },  # fmt: skip
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "data": f"{src.get('model', 'a KV dump')}: {L} layers x {T} tokens ({args.kv_dir}); "
        f"table set fitted on its first {FIT} tokens, chunks cut from the other {usable}",
        "shape": f"[tokens, {k.shape[2]} KV heads, {k.shape[3]}] per layer and kind",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = [
        "# kvzip-vllm tier: stored bytes per chunk size",
        "",
        f"{result['what']}. Device {result['device']}, {result['date']}, versions "
        f"{result['versions']}. Data: {result['data']}; shape {result['shape']}. "
        f"Command: `{result['command']}`.",
        "",
        "| chunk_tokens | chunks | ratio (blobs) | ratio (held: blobs, plans, arena rounding) "
        "| tokens lost at the boundary (mean) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['chunk_tokens']} | {r['chunks']} | {r['ratio_blobs']} | {r['ratio_held']} "
            f"| {r['mean_tokens_lost_at_the_boundary']} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
