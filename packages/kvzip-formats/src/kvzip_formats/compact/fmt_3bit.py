"""``3bit``: every transformed channel at 3 bits (Lloyd-Max levels), one fp16 token scale,
one bf16 sink token. Row at head_dim 128: 48 code bytes + 2 = 50 bytes, 3.125 bits; at
head_dim 64: 26 bytes, 3.25 bits. Document: spec/3bit.md."""

from kvzip_formats.compact.codec import CompactSpec

SPEC = CompactSpec(name="3bit", k_groups=((1.0, 3),), v_groups=((1.0, 3),), sink_tokens=1, version=1)
