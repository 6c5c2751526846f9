"""The CPU-side parts of the real-weights check in vLLM (``benchmarks/vllm_quality.py``) and
of carrying the model to the GPU machine (``benchmarks/carry_model.py``): the top-k KL
statistic against a direct computation, vLLM's flat log-prob layout, the decode-position
mask, and the model pack rebuilding a folder byte for byte (or refusing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import carry_model as cm  # noqa: E402
import vllm_quality as vq  # noqa: E402


def _log_probs(rng, P, V, scale=3.0):
    return torch.log_softmax(torch.tensor(rng.normal(size=(P, V)) * scale), dim=-1)


def _reference_coarse_kl(lp_ref: torch.Tensor, ref_ids, fmt_ids, fmt_lp) -> list[float]:
    """Row by row with dict look-ups: the reference's top-k (from its full log-probs), the
    format's value from its list or else its smallest listed value, plus the rest bucket."""
    out = []
    for r in range(lp_ref.shape[0]):
        listed = dict(zip(fmt_ids[r].tolist(), fmt_lp[r].astype(np.float64).tolist(), strict=True))
        floor = min(listed.values())
        head, pa_sum, pb_sum = 0.0, 0.0, 0.0
        for t in ref_ids[r].tolist():
            a = float(lp_ref[r, t])
            b = listed.get(t, floor)
            head += np.exp(a) * (a - b)
            pa_sum += np.exp(a)
            pb_sum += np.exp(b)
        eps = len(ref_ids[r]) * 2.0**-23  # float32 rounding of k summed probabilities
        ra, rb = 1.0 - pa_sum, max(1.0 - pb_sum, eps)
        out.append(head + (ra * np.log(ra / rb) if ra > eps else 0.0))
    return out


def test_coarse_kl_with_whole_vocabulary_lists_is_the_full_kl():
    rng = np.random.default_rng(0)
    P, V = 40, 97
    a = _log_probs(rng, P, V)
    b = torch.log_softmax(a + torch.tensor(rng.normal(size=(P, V)) * 0.3), dim=-1)
    ai, al = vq.topk_lists(a, V)
    bi, bl = vq.topk_lists(b, V)
    got = vq.coarse_kl(ai, al, bi, bl)
    want = vq.full_kl(a, b).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert (want > 1e-4).all()  # a real difference was measured, not zeros


@pytest.mark.parametrize("noise", [0.05, 1.5])
def test_coarse_kl_from_topk_lists_matches_a_direct_computation(noise):
    rng = np.random.default_rng(1)
    P, V, k = 64, 500, 20
    a = _log_probs(rng, P, V)
    b = torch.log_softmax(a + torch.tensor(rng.normal(size=(P, V)) * noise), dim=-1)
    ai, al = vq.topk_lists(a, k)
    bi, bl = vq.topk_lists(b, k)
    got = vq.coarse_kl(ai, al, bi, bl)
    want = _reference_coarse_kl(a, ai, bi, bl)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    # rows whose reference top-k all appear in the format's list: the coarse-grained KL
    # with exact values, which by data processing never exceeds the full KL
    full = vq.full_kl(a, b).numpy()
    exact = np.array([set(ai[r]) <= set(bi[r]) for r in range(P)])
    missing = ~exact
    if noise < 0.1:
        assert exact.sum() > P // 2
    else:
        assert missing.sum() > P // 2  # the floor rule is exercised
    assert (got[exact] <= full[exact] + 1e-9).all()


def test_coarse_kl_rejects_mismatched_lists():
    ids = np.zeros((3, 4), dtype=np.int32)
    lp = np.full((3, 4), -1.0, dtype=np.float32)
    with pytest.raises(ValueError, match="same positions"):
        vq.coarse_kl(ids, lp, ids[:2], lp[:2])
    with pytest.raises(ValueError, match="same shape"):
        vq.coarse_kl(ids, lp[:, :3], ids, lp)


def _flat(rows, first_empty):
    """A FlatLogprobs-shaped object as vLLM builds it: per position the target first."""
    starts, ends, ids, lps = [], [], [], []
    if first_empty:
        starts.append(0)
        ends.append(0)
    for tgt, top in rows:
        starts.append(len(ids))
        for t, v in [tgt, *top]:
            ids.append(t)
            lps.append(v)
        ends.append(len(ids))
    return SimpleNamespace(start_indices=starts, end_indices=ends, token_ids=ids, logprobs=lps)


def test_flat_rows_reads_vllm_layout_and_checks_widths():
    rows = [((5, -2.0), [(1, -0.1), (5, -2.0)]), ((7, -3.0), [(2, -0.2), (3, -0.4)])]
    ids, lp, target, sampled = vq._flat_rows(_flat(rows, True), 2, skip_first=True)
    assert ids.tolist() == [[1, 5], [2, 3]]
    np.testing.assert_array_equal(lp, np.array([[-0.1, -2.0], [-0.2, -0.4]], np.float32))
    assert target.tolist() == [-2.0, -3.0] and sampled.tolist() == [5, 7]
    with pytest.raises(RuntimeError, match="log-probs per position"):
        vq._flat_rows(_flat(rows, True), 3, skip_first=True)
    with pytest.raises(RuntimeError, match="first position"):
        vq._flat_rows(_flat(rows, False), 2, skip_first=True)


def test_decode_mask_counts_steps_only_after_equal_generated_tokens():
    ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    fmt = np.array([[1, 2, 9, 4], [5, 2, 3, 4]])
    # step j counts when tokens 0..j-1 are equal; step 0 is the prefill's last position
    assert vq.decode_mask(ref, fmt).tolist() == [
        [False, True, True, False],
        [False, False, False, False],
    ]


def test_sqrt_tolerance_is_the_triangle_bound():
    assert vq.sqrt_tolerance(0.04, 0.09) == pytest.approx(0.5)
    assert vq.sqrt_tolerance(-1e-12, 0.0) == 0.0


# ------------------------------------------------------------------------------ model pack


def test_bf16_bits_rounds_like_torch():
    rng = np.random.default_rng(2)
    x = rng.normal(size=4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096)
    # exact ties between two bf16 values (round half to even), infinities, NaN, zero signs
    ties = (np.arange(64, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)
    x = np.concatenate(
        [x, ties.view(np.float32), np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)]
    )
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(cm.bf16_bits(x), want)


def _hf_rows_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face row h*D + t*D/2 + j is GGUF row h*D + 2*j + t (by index, row by row)."""
    D = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for t in range(2):
            for j in range(D // 2):
                out[h * D + t * D // 2 + j] = w[h * D + 2 * j + t]
    return out


def _fake_model(tmp: Path, n_head=4, n_kv=2, hidden=64, vocab=48):
    """A tiny Llama GGUF (Q8_0 embedding, Q4_1 projections, f32 norms) and the bf16 HF folder
    of it, built with gguf's own dequantization and torch's bf16 cast."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from safetensors.torch import save_file

    rng = np.random.default_rng(3)
    head_dim = hidden // n_head
    spec = {
        "token_embd.weight": ((vocab, hidden), Q.Q8_0, "model.embed_tokens.weight", None),
        "blk.0.attn_q.weight": (
            (hidden, hidden),
            Q.Q4_1,
            "model.layers.0.self_attn.q_proj.weight",
            n_head,
        ),
        "blk.0.attn_k.weight": (
            (n_kv * head_dim, hidden),
            Q.Q4_1,
            "model.layers.0.self_attn.k_proj.weight",
            n_kv,
        ),
        "blk.0.attn_v.weight": (
            (n_kv * head_dim, hidden),
            Q.Q4_1,
            "model.layers.0.self_attn.v_proj.weight",
            None,
        ),
        "blk.0.attn_norm.weight": ((hidden,), Q.F32, "model.layers.0.input_layernorm.weight", None),
        "output_norm.weight": ((hidden,), Q.F32, "model.norm.weight", None),
    }
    writer = gguf.GGUFWriter(str(tmp / "tiny.gguf"), "llama")
    hf = {}
    for name, (shape, qt, hf_name, heads) in spec.items():
        x = (rng.normal(size=shape) * 0.05).astype(np.float32)
        if qt == Q.F32:
            writer.add_tensor(name, x)
            deq = x
        else:
            raw = gguf.quants.quantize(x, qt)
            writer.add_tensor(name, raw, raw_dtype=qt)
            deq = gguf.quants.dequantize(raw, qt).reshape(shape)
        if heads:
            deq = _hf_rows_from_gguf(deq, heads)
        hf[hf_name] = torch.from_numpy(np.ascontiguousarray(deq)).to(torch.bfloat16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = tmp / "tiny-hf"
    folder.mkdir()
    save_file(hf, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "hidden_size": hidden,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": list(range(vocab))}))
    return tmp / "tiny.gguf", folder


def test_pack_unpack_rebuilds_the_folder_byte_for_byte(tmp_path):
    g, folder = _fake_model(tmp_path)
    out = tmp_path / "carry"
    # a first piece of 2 KiB forces a split: the rebuild needs both piece folders
    m = cm.pack(g, folder, out, [2 / 1024, 64])
    assert [p["dir"] for p in m["pieces"]] == ["p0", "p1"]
    assert m["pieces"][0]["size"] == 2048
    back = cm.unpack([out / "p1", out / "p0"], tmp_path / "rebuilt")
    names = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in back.iterdir()) == names
    for n in names:
        assert (back / n).read_bytes() == (folder / n).read_bytes(), n


def test_unpack_refuses_a_missing_or_damaged_piece(tmp_path):
    g, folder = _fake_model(tmp_path)
    out = tmp_path / "carry"
    cm.pack(g, folder, out, [2 / 1024, 64])
    with pytest.raises(cm.CarryError, match="piece smollm2.pack.001 is missing: carry p1/"):
        cm.unpack([out / "p0"], tmp_path / "x")
    piece = out / "p1" / "smollm2.pack.001"
    b = bytearray(piece.read_bytes())
    b[len(b) // 2] ^= 1
    piece.write_bytes(bytes(b))
    with pytest.raises(cm.CarryError, match="damaged"):
        cm.unpack([out / "p0", out / "p1"], tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_pack_refuses_a_folder_the_gguf_does_not_reproduce(tmp_path):
    from safetensors.torch import load_file, save_file

    g, folder = _fake_model(tmp_path)
    st = folder / "model.safetensors"
    t = load_file(str(st))
    w = t["model.layers.0.self_attn.k_proj.weight"].clone()
    w.view(-1)[5] = w.view(-1)[5] * 1.5 + 0.01
    t["model.layers.0.self_attn.k_proj.weight"] = w
    save_file(t, str(st), metadata={"format": "pt"})
    with pytest.raises(cm.CarryError, match=r"k_proj.weight: the GGUF's blk.0.attn_k.weight"):
        cm.pack(g, folder, tmp_path / "carry", [64])


def test_pack_refuses_pieces_too_small(tmp_path):
    g, folder = _fake_model(tmp_path)
    with pytest.raises(cm.CarryError, match="pass larger or more --sizes-mib"):
        cm.pack(g, folder, tmp_path / "carry", [1 / 1024])
