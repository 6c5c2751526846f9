#!/usr/bin/env python3
"""Carry the embedded SmolLM2-135M to the GPU machine: a compact, lossless pack of its bf16
Hugging Face folder, split into pieces that fit the device calls.

``kvzip_eval.model.hf_folder()`` turns the embedded GGUF (Q4_1 layers, a Q8_0 embedding,
f32 norms) into a bf16 folder of 269 MB. Every bf16 weight there is a float32 dequantization
of a GGUF block (Q4_1: ``d * q + m``; Q8_0: ``d * q``) rounded to bf16 (round to nearest
even), and the q/k projections' rows are put back in Hugging Face's head order. So the pack
keeps the GGUF's own blocks (scales and codes, as separate xz streams) plus a recipe per
tensor, and ``unpack`` rebuilds the folder byte for byte with numpy alone (no ``gguf``, no
transformers on the GPU machine): every file's SHA-256 is checked against the manifest.

``pack`` checks, tensor by tensor, that its recipe reproduces the folder's bytes before it
writes anything; a folder that is not the GGUF's conversion is refused with the tensor named.

    python carry_model.py pack --out .carry/smollm2 [--gguf G] [--folder F] [--sizes-mib 33,58]
    python carry_model.py unpack --out DIR PIECE_DIR [PIECE_DIR ...]

``pack`` writes ``OUT/p0/``, ``OUT/p1/``, ... each holding one piece and a copy of
``manifest.json``; piece ``i`` is at most ``sizes_mib[i]`` MiB. ``unpack`` takes the piece
folders (any order) and writes the HF folder.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

PACK_VERSION = 1
MANIFEST = "manifest.json"
PIECE = "smollm2.pack.{:03d}"
#: GGUF block geometry: (elements per block, bytes of scales, bytes of codes) per type.
BLOCKS = {"Q4_1": (32, 4, 16), "Q8_0": (32, 2, 32), "F32": (1, 0, 4)}
XZ_PRESET = 6

#: Llama tensor names: Hugging Face name pattern -> GGUF name.
_NAMES = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "blk.{}.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "blk.{}.attn_q.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "blk.{}.attn_k.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "blk.{}.attn_v.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "blk.{}.attn_output.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "blk.{}.ffn_gate.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "blk.{}.ffn_up.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "blk.{}.ffn_down.weight"),
]


class CarryError(ValueError):
    """The pack cannot be made or rebuilt; the message says what and where."""


# ------------------------------------------------------------------------------ numerics


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN -> 0x7FC0 (as torch)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(
        np.uint16
    )
    nan = np.isnan(x)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def dequantize(kind: str, scales: bytes, codes: bytes, n: int) -> np.ndarray:
    """float32 values of ``n`` elements of GGUF type ``kind`` from its scale and code bytes."""
    if kind == "F32":
        return np.frombuffer(codes, dtype="<f4", count=n).astype(np.float32)
    per, sb, cb = BLOCKS[kind]
    nb = n // per
    s = np.frombuffer(scales, dtype=np.uint8).reshape(nb, sb)
    c = np.frombuffer(codes, dtype=np.uint8).reshape(nb, cb)
    d = s[:, 0:2].copy().view("<f2").astype(np.float32)  # [nb, 1]
    if kind == "Q8_0":
        return (d * c.view(np.int8).astype(np.float32)).reshape(-1)
    m = s[:, 2:4].copy().view("<f2").astype(np.float32)
    q = np.concatenate([c & 0x0F, c >> 4], axis=1).astype(np.float32)  # low nibbles first
    return (d * q + m).reshape(-1)


def head_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from llama.cpp's rotary order back to Hugging Face's: per
    head, rows ``[0, 2, 4, ..., 1, 3, 5, ...]`` of GGUF become rows ``0..dim-1``."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rebuild(recipe: dict, streams: dict[str, bytes]) -> bytes:
    """The bf16 bytes of one Hugging Face tensor from the pack's streams."""
    kind, n = recipe["type"], int(np.prod(recipe["shape"]))
    per, sb, cb = BLOCKS[kind]
    b0, nb = recipe["block"], n // per
    scales = streams[f"{kind}.scales"][b0 * sb : (b0 + nb) * sb] if sb else b""
    codes = streams[f"{kind}.codes"][b0 * cb : (b0 + nb) * cb]
    w = dequantize(kind, scales, codes, n).reshape(recipe["shape"])
    if recipe.get("n_head"):
        w = head_order(w, recipe["n_head"])
    return bf16_bits(w).tobytes()


# ------------------------------------------------------------------------------ safetensors


def read_safetensors_header(path: Path) -> tuple[bytes, dict]:
    with open(path, "rb") as f:
        raw = f.read(8)
        (n,) = struct.unpack("<Q", raw)
        raw += f.read(n)
    return raw, json.loads(raw[8:])


def _tensors_in_order(header: dict) -> list[tuple[str, dict]]:
    items = [(k, v) for k, v in header.items() if k != "__metadata__"]
    return sorted(items, key=lambda kv: kv[1]["data_offsets"][0])


# ------------------------------------------------------------------------------ pack


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _gguf_name(hf_name: str) -> str:
    for pat, g in _NAMES:
        m = re.fullmatch(pat, hf_name)
        if m:
            return g.format(*m.groups())
    raise CarryError(
        f"tensor {hf_name!r} has no Llama GGUF counterpart; supported names: "
        + ", ".join(p for p, _ in _NAMES)
    )


def pack(
    gguf_path: Path, folder: Path, out: Path, sizes_mib: list[float], identity: str | None = None
) -> dict:
    """Write the pieces and manifests into ``out/p<i>/``; returns the manifest.

    ``identity``: the folder's kvzip model identity where it is packed (recorded, so the GPU
    side can tell a calibration made for these bytes even if its transformers serializes
    the config differently)."""
    import gguf  # only here: the GPU machine needs numpy alone

    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "config.json").read_text())
    n_q = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_q)
    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    st_files = sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors")
    other = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix != ".safetensors")
    if not st_files:
        raise CarryError(f"{folder} holds no .safetensors file")
    streams = {f"{k}.{s}": bytearray() for k in BLOCKS for s in ("scales", "codes")}
    blocks_used = dict.fromkeys(BLOCKS, 0)
    files = []
    for name in st_files:
        path = folder / name
        head_raw, header = read_safetensors_header(path)
        recipes = []
        with open(path, "rb") as f:
            for hf_name, meta in _tensors_in_order(header):
                if meta["dtype"] != "BF16":
                    raise CarryError(f"{name}:{hf_name} is {meta['dtype']}; only BF16 is packed")
                g = by_name.get(_gguf_name(hf_name))
                if g is None:
                    raise CarryError(f"{hf_name}: GGUF {gguf_path} has no {_gguf_name(hf_name)}")
                kind = g.tensor_type.name
                if kind not in BLOCKS:
                    raise CarryError(
                        f"{g.name} is GGUF type {kind}; supported: {', '.join(BLOCKS)}"
                    )
                per, sb, cb = BLOCKS[kind]
                n = int(g.n_elements)
                if n != int(np.prod(meta["shape"])) or n % per:
                    raise CarryError(f"{hf_name}: shape {meta['shape']} vs GGUF {g.shape}")
                raw = np.asarray(g.data).view(np.uint8).reshape(n // per, sb + cb)
                streams[f"{kind}.scales"] += raw[:, :sb].tobytes()
                streams[f"{kind}.codes"] += raw[:, sb:].tobytes()
                recipe = {
                    "name": hf_name,
                    "gguf": g.name,
                    "type": kind,
                    "shape": list(meta["shape"]),
                    "block": blocks_used[kind],
                }
                blocks_used[kind] += n // per
                if ".attn_q." in g.name:
                    recipe["n_head"] = n_q
                elif ".attn_k." in g.name:
                    recipe["n_head"] = n_kv
                a, b = meta["data_offsets"]
                f.seek(len(head_raw) + a)
                want = f.read(b - a)
                own = {
                    f"{kind}.scales": raw[:, :sb].tobytes(),
                    f"{kind}.codes": raw[:, sb:].tobytes(),
                }
                got = rebuild(dict(recipe, block=0), own)
                if got != want:
                    bad = int(
                        (np.frombuffer(got, np.uint16) != np.frombuffer(want, np.uint16)).sum()
                    )
                    raise CarryError(
                        f"{name}:{hf_name}: the GGUF's {g.name} ({kind}) does not reproduce the "
                        f"folder's bf16 bytes ({bad} of {n} values differ); this folder is not "
                        f"the conversion of {gguf_path}"
                    )
                recipes.append(recipe)
        total = os.path.getsize(path)
        end = max((m["data_offsets"][1] for _, m in _tensors_in_order(header)), default=0)
        if len(head_raw) + end != total:
            raise CarryError(f"{name}: {total} bytes, header + data say {len(head_raw) + end}")
        files.append(
            {
                "name": name,
                "kind": "safetensors",
                "size": total,
                "sha256": _file_sha(path),
                "header": len(head_raw),
                "tensors": recipes,
            }
        )
    for name in other:
        files.append(
            {
                "name": name,
                "kind": "raw",
                "size": (folder / name).stat().st_size,
                "sha256": _file_sha(folder / name),
            }
        )

    # Sections: each compressed on its own, concatenated into one payload.
    sections, payload = [], io.BytesIO()

    def add(name: str, data: bytes) -> None:
        comp = lzma.compress(data, preset=XZ_PRESET)
        sections.append(
            {
                "name": name,
                "offset": payload.tell(),
                "length": len(comp),
                "raw": len(data),
                "sha256": _sha(data),
            }
        )
        payload.write(comp)

    for f in files:
        if f["kind"] == "raw":
            add(f"file:{f['name']}", (folder / f["name"]).read_bytes())
        else:
            add(f"header:{f['name']}", read_safetensors_header(folder / f["name"])[0])
    for k, v in streams.items():
        if v:
            add(f"stream:{k}", bytes(v))
    data = payload.getvalue()
    limits = [int(s * 2**20) for s in sizes_mib]
    cuts, pos = [], 0
    for lim in limits:
        if pos >= len(data):
            break
        cuts.append((pos, min(len(data), pos + lim)))
        pos = cuts[-1][1]
    if pos < len(data):
        raise CarryError(
            f"the pack is {len(data) / 2**20:.1f} MiB; pieces of {sizes_mib} MiB hold only "
            f"{sum(limits) / 2**20:.1f} MiB: pass larger or more --sizes-mib"
        )
    manifest = {
        "version": PACK_VERSION,
        "model": folder.name,
        "identity": identity,
        "source_gguf": {"name": Path(gguf_path).name, "sha256": _file_sha(Path(gguf_path))},
        "files": files,
        "sections": sections,
        "payload": {"size": len(data), "sha256": _sha(data)},
        "pieces": [
            {
                "name": PIECE.format(i),
                "dir": f"p{i}",
                "offset": a,
                "size": b - a,
                "sha256": _sha(data[a:b]),
            }
            for i, (a, b) in enumerate(cuts)
        ],
    }
    out.mkdir(parents=True, exist_ok=True)
    for p in manifest["pieces"]:
        d = out / p["dir"]
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        (d / p["name"]).write_bytes(data[p["offset"] : p["offset"] + p["size"]])
        (d / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _file_sha(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------------------ unpack


def unpack(piece_dirs: list[Path], out: Path) -> Path:
    """Rebuild the HF folder into ``out`` (written to a temp dir, then renamed) from the piece
    folders; every piece, section and file is checked against the manifest's SHA-256."""
    piece_dirs = [Path(d) for d in piece_dirs]
    manifests = [d / MANIFEST for d in piece_dirs if (d / MANIFEST).is_file()]
    if not manifests:
        raise CarryError(f"no {MANIFEST} in any of {[str(d) for d in piece_dirs]}")
    manifest = json.loads(manifests[0].read_text())
    if manifest.get("version") != PACK_VERSION:
        raise CarryError(
            f"pack version {manifest.get('version')}; this script reads {PACK_VERSION}"
        )
    for m in manifests[1:]:
        if json.loads(m.read_text())["payload"] != manifest["payload"]:
            raise CarryError(f"{m} belongs to another pack than {manifests[0]}")
    chunks = []
    for p in manifest["pieces"]:
        found = [d / p["name"] for d in piece_dirs if (d / p["name"]).is_file()]
        if not found:
            raise CarryError(
                f"piece {p['name']} is missing: carry {p['dir']}/ too (given: "
                f"{[str(d) for d in piece_dirs]})"
            )
        b = found[0].read_bytes()
        if len(b) != p["size"] or _sha(b) != p["sha256"]:
            raise CarryError(f"piece {found[0]} is damaged (size or SHA-256 differs)")
        chunks.append(b)
    data = b"".join(chunks)
    if _sha(data) != manifest["payload"]["sha256"]:
        raise CarryError("the joined pieces do not match the manifest's payload SHA-256")
    sec = {}
    for s in manifest["sections"]:
        raw = lzma.decompress(data[s["offset"] : s["offset"] + s["length"]])
        if len(raw) != s["raw"] or _sha(raw) != s["sha256"]:
            raise CarryError(f"section {s['name']} decompresses to the wrong bytes")
        sec[s["name"]] = raw
    streams = {k.split(":", 1)[1]: v for k, v in sec.items() if k.startswith("stream:")}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for f in manifest["files"]:
            path = tmp / f["name"]
            if f["kind"] == "raw":
                path.write_bytes(sec[f"file:{f['name']}"])
            else:
                h = hashlib.sha256()
                with open(path, "wb") as w:
                    for part in [sec[f"header:{f['name']}"]] + [
                        rebuild(r, streams) for r in f["tensors"]
                    ]:
                        w.write(part)
                        h.update(part)
            if path.stat().st_size != f["size"] or _file_sha(path) != f["sha256"]:
                raise CarryError(f"rebuilt {f['name']} differs from the packed folder's")
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------ CLI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write the pieces")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--folder", type=Path, default=None, help="default: its converted HF folder")
    p.add_argument("--sizes-mib", default="33,58", help="largest size of each piece, in MiB")
    u = sub.add_parser("unpack", help="rebuild the HF folder")
    u.add_argument("--out", required=True, type=Path)
    u.add_argument("pieces", nargs="+", type=Path, help="folders holding the pieces")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "pack":
            from transformers import AutoConfig

            from kvzip_eval.model import embedded_gguf, hf_folder, model_identity

            g = a.gguf or embedded_gguf()
            folder = a.folder or hf_folder(g)
            sizes = [float(x) for x in a.sizes_mib.split(",") if x.strip()]
            ident = model_identity(folder, AutoConfig.from_pretrained(folder))
            m = pack(g, folder, a.out, sizes, identity=ident)
            print(f"model identity {ident}")
            for piece in m["pieces"]:
                print(f"{a.out / piece['dir']}: {piece['size'] / 2**20:.2f} MiB")
            print(
                f"pack {m['payload']['size'] / 2**20:.2f} MiB for a folder of "
                f"{sum(f['size'] for f in m['files']) / 2**20:.1f} MiB"
            )
        else:
            print(unpack(a.pieces, a.out))
    except CarryError as e:
        print(f"carry_model: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
