"""``3.5bit``: K rows at 4 bits, V rows at 3 bits (Lloyd-Max levels), one fp16 token scale
per row, one bf16 sink token. Rows at head_dim 128: K 66 bytes, V 50 bytes (mean 58: 3.6251
bits); at head_dim 64: 34 and 26 bytes (3.7501 bits).

Spending the bits on K (whose error dominates) beats splitting every row into 4- and 3-bit
halves: mean KL 0.054 against 0.076 on SmolLM2 (results/quality/ablation.md). Document:
spec/3.5bit.md."""

from kvzip_formats.compact.codec import CompactSpec

SPEC = CompactSpec(
    name="3.5bit", k_groups=((1.0, 4),), v_groups=((1.0, 3),), sink_tokens=1, version=1
)
