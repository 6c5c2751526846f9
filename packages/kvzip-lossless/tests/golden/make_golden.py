"""Regenerate the golden vectors (only with a format version bump: spec/blob.md, History).

valid_*.kvzl: a blob; valid_*.u16: the exact bf16 bit patterns it restores (little-endian
uint16, C order) and valid_*.json its shape. invalid_*.kvzl: a damaged blob; the expected
error's text is in invalid.json.
Run: uv run python packages/kvzip-lossless/tests/golden/make_golden.py
"""

import json
import zlib
from pathlib import Path

import numpy as np
import torch

import kvzip_lossless as kl
from kvzip_lossless import blob as B

HERE = Path(__file__).parent


def values():
    g = np.random.default_rng(20261129)
    # KV-like: per-channel offset and scale, plus specials (NaN, inf, zeros, subnormal, huge).
    kv = g.standard_normal((300, 2, 16)) * g.uniform(0.1, 3, (1, 2, 16)) + g.normal(
        0, 2, (1, 2, 16)
    )
    kv = torch.from_numpy(kv.astype(np.float32)).bfloat16()
    kv[3, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    kv[7, 1, 5] = 1e-40
    kv[9, 1, 6] = -3e38
    bits = torch.from_numpy(g.integers(0, 1 << 16, 300, dtype=np.uint16).astype(np.int16))
    return {
        "kv": (kv, 64),
        "randombits": (bits.view(torch.bfloat16), 1024),
        "const": (torch.full((5, 7), 1.5, dtype=torch.bfloat16), 4),
        "empty": (torch.zeros(0, 4, dtype=torch.bfloat16), 1024),
    }


def tables():
    """A calibrated table set (one K slot, one V slot) fitted on other draws of the same law."""
    g = np.random.default_rng(7)

    def mk():
        return torch.from_numpy(
            (g.standard_normal((500, 2, 16)) * 2 + 1).astype(np.float32)
        ).bfloat16()

    return kl.build_kv_tables([[(mk(), mk())]])


def zlib_bomb(blob: bytes, size: int) -> bytes:
    """``blob`` with its embedded table replaced by a zlib stream that starts like the right
    table (same columns, one bucket) but inflates to ``size`` bytes (16 MiB from 16 KB), the
    header and its CRC rewritten to match: only a size cap stops it."""
    buf = memoryview(blob)
    h = B.parse_header(buf)
    assert h.embedded is not None
    good = zlib.decompress(h.embedded)
    bomb = zlib.compress(good[:12] + bytes(size - 12), 9)
    head = B.pack_header(
        h.shape, h.columns, h.rows_per_tile, h.table_id, h.table_slot, bomb,
        h.lengths, h.modes, h.n_exc, h.checksums,
    )  # fmt: skip
    return head + bytes(buf[h.tiles_start :])


def main():
    invalid = {}
    ts = tables()
    ts.save(HERE / "tables.kvzt")
    vals = values()
    vals["kv_calibrated"] = (vals["kv"][0], 100)
    for name, (x, rpt) in vals.items():
        if name == "kv_calibrated":
            blob = kl.compress(x, tables=ts, slot=0, rows_per_tile=rpt)
        else:
            blob = kl.compress(x, rows_per_tile=rpt)
        (HERE / f"valid_{name}.kvzl").write_bytes(blob)
        (HERE / f"valid_{name}.u16").write_bytes(
            x.view(torch.int16).numpy().astype("<i2").tobytes()
        )
        (HERE / f"valid_{name}.json").write_text(
            json.dumps({"shape": list(x.shape), "rows_per_tile": rpt})
        )
    kv = (HERE / "valid_kv.kvzl").read_bytes()
    cases = {
        "truncated": (kv[:-9], "does not match its tile directory"),
        "magic": (b"KVZX" + kv[4:], "not a kvzip-lossless blob"),
        "version": (kv[:4] + b"\x09\x00" + kv[6:], "format version 9"),
        "header_bitflip": (kv[:45] + bytes([kv[45] ^ 1]) + kv[46:], "header checksum mismatch"),
        "payload_bitflip": (kv[:-20] + bytes([kv[-20] ^ 4]) + kv[-19:], "tile"),
        "empty": (b"", "blob truncated"),
        "embedded_bomb": (zlib_bomb(kv, 16 << 20), "inflates to more than the 2124 bytes"),
    }
    for name, (b, msg) in cases.items():
        (HERE / f"invalid_{name}.kvzl").write_bytes(b)
        invalid[name] = msg
    (HERE / "invalid.json").write_text(json.dumps(invalid, indent=1) + "\n")


if __name__ == "__main__":
    main()
