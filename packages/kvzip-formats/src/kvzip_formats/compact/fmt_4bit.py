"""``4bit``: K and V rows with every transformed channel at 4 bits (Lloyd-Max levels), one
fp16 token scale per row, one bf16 sink token. Row at head_dim 128: 64 code bytes + 2 = 66
bytes, 4.1251 bits with the sink; at head_dim 64: 34 bytes, 4.2501 bits.

K 5 / V 3 bits lost to plain 4 / 4 (mean KL 0.032 against 0.029; SmolLM2, 2,048 held-out
tokens; results/quality/ablation.md). Document: spec/4bit.md."""

from kvzip_formats.compact.codec import CompactSpec

SPEC = CompactSpec(
    name="4bit", k_groups=((1.0, 4),), v_groups=((1.0, 4),), sink_tokens=1, version=1
)
