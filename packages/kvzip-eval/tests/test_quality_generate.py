import pytest

from kvzip_eval.corpus import token_windows
from kvzip_eval.quality.generate import WIDTH_STEP, batches, generate, width
from kvzip_formats import get_format


def test_bf16_generation_identical_and_exact_probe(loaded):
    prompts = token_windows(loaded.tokenizer, 3, 24, seed=5).tolist()
    prompts[1] = prompts[1][:15]  # unequal lengths: left padding
    probes = {"bf16": get_format("bf16"), "int4": get_format("int4")}
    ref, exact = generate(loaded, prompts, None, max_new_tokens=6, batch_size=3, probes=probes)
    assert exact == {"bf16"}
    same, _ = generate(loaded, prompts, get_format("bf16"), max_new_tokens=6, batch_size=3)
    assert same == ref and all(len(o) > 0 for o in ref)


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_batch_invariant(loaded, fmt):
    # The same prompt alone (its batch filled with copies of it) and beside two other
    # prompts of other lengths, in another position of the batch: bit-identical tokens.
    f = get_format(fmt) if fmt else None
    wins = token_windows(loaded.tokenizer, 3, 40, seed=11).tolist()
    p, q, r = wins[0][:33], wins[1][:40], wins[2][:37]  # one width bucket, three pad counts
    alone, _ = generate(loaded, [p], f, max_new_tokens=12, batch_size=3)
    mixed, _ = generate(loaded, [q, r, p], f, max_new_tokens=12, batch_size=3)
    assert len(alone[0]) > 0 and mixed[2] == alone[0]
    again, _ = generate(loaded, [r, p], f, max_new_tokens=12, batch_size=3)
    assert again[1] == alone[0] and again[0] == mixed[1]


def test_batches_group_by_width():
    prompts = [[1] * n for n in (5, WIDTH_STEP + 1, 7, 9, 2 * WIDTH_STEP)]
    assert width(1) == WIDTH_STEP and width(WIDTH_STEP) == WIDTH_STEP
    assert batches(prompts, 2) == [[0, 2], [3], [1, 4]]


def test_bad_arguments(loaded):
    with pytest.raises(ValueError, match="batch_size"):
        generate(loaded, [[1, 2]], None, max_new_tokens=2, batch_size=0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(loaded, [[]], None, max_new_tokens=2)


@pytest.mark.gpu
def test_batch_invariant_and_reproducible_on_cuda():
    # On the GPU: one prompt alone and in a batch of others gives the same tokens, and the
    # bf16 reference run twice in one process is identical (words changed exactly 0).
    # KVZIP_MODEL: a Llama HF folder (e.g. the carried SmolLM2), else the embedded model.
    import os

    import torch

    from kvzip_eval.model import load_model

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    gl = load_model(os.environ.get("KVZIP_MODEL"), device="cuda")
    wins = token_windows(gl.tokenizer, 8, 200, seed=3).tolist()
    prompts = [w[: 150 + 7 * i] for i, w in enumerate(wins)]  # lengths 150-199: one bucket
    for fmt in (None, get_format("int4")):
        alone, _ = generate(gl, [prompts[3]], fmt, max_new_tokens=24, batch_size=8)
        mixed, _ = generate(gl, prompts, fmt, max_new_tokens=24, batch_size=8)
        again, _ = generate(gl, prompts[::-1], fmt, max_new_tokens=24, batch_size=8)
        assert mixed[3] == alone[0] and again[::-1] == mixed
