"""``3bit``: K rows hold the most important half of the transformed channels at 4 bits and
the other half at 3 (3.5 bits); V rows the same split at 3 and 2 bits (2.5 bits); one fp16
token scale per row, one bf16 sink token. Rows at head_dim 128: K 56 + 2 = 58 bytes, V 40 +
2 = 42 bytes (mean 50: 3.1251 bits); at head_dim 64: 30 and 22 bytes (3.2501 bits).

Measured on SmolLM2 (2,048 held-out tokens): mean KL 0.140 against 0.192 for K and V at 3
bits each and 0.199 for K 4 / V 2 bits; int4 0.170 (results/quality/ablation.md). Document:
spec/3bit.md."""

from kvzip_formats.compact.codec import CompactSpec

SPEC = CompactSpec(
    name="3bit",
    k_groups=((0.5, 4), (0.5, 3)),
    v_groups=((0.5, 3), (0.5, 2)),
    sink_tokens=1,
    version=1,
)
