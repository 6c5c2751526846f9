from kvzip_eval.corpus import token_windows
from kvzip_eval.quality.generate import generate
from kvzip_formats import get_format


def test_bf16_generation_identical_and_exact_probe(loaded):
    prompts = token_windows(loaded.tokenizer, 3, 24, seed=5).tolist()
    prompts[1] = prompts[1][:15]  # unequal lengths: left padding
    probes = {"bf16": get_format("bf16"), "int4": get_format("int4")}
    ref, exact = generate(loaded, prompts, None, max_new_tokens=6, batch_size=3, probes=probes)
    assert exact == {"bf16"}
    same, _ = generate(loaded, prompts, get_format("bf16"), max_new_tokens=6, batch_size=3)
    assert same == ref and all(len(o) > 0 for o in ref)


def test_batched_equals_one_by_one_for_bf16(loaded):
    # Left padding must not change what a row generates (positions, masks, pad handling).
    prompts = token_windows(loaded.tokenizer, 2, 20, seed=6).tolist()
    prompts[0] = prompts[0][:12]
    batched, _ = generate(loaded, prompts, None, max_new_tokens=5, batch_size=2)
    single = [generate(loaded, [p], None, max_new_tokens=5, batch_size=1)[0][0] for p in prompts]
    # bf16 matmuls of a padded batch may round differently; demand agreement of the first
    # tokens, which a wrong position or mask would break immediately.
    assert [b[:2] for b in batched] == [s[:2] for s in single]
