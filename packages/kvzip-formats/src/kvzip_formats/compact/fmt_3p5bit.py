"""``3.5bit``: the most important half of the transformed channels at 4 bits, the other half
at 3 bits, one fp16 token scale, one bf16 sink token. Row at head_dim 128: 56 code bytes + 2
= 58 bytes, 3.625 bits; at head_dim 64: 30 bytes, 3.75 bits. Document: spec/3.5bit.md."""

from kvzip_formats.compact.codec import CompactSpec

SPEC = CompactSpec(name="3.5bit", k_groups=((1.0, 4),), v_groups=((1.0, 3),), sink_tokens=1, version=1)
