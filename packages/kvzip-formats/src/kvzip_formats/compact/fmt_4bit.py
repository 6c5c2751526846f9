"""``4bit``: every transformed channel at 4 bits (Lloyd-Max levels), one fp16 token scale,
one bf16 sink token. Row at head_dim 128: 64 code bytes + 2 = 66 bytes, 4.125 bits (4.1251
with the sink); at head_dim 64: 34 bytes, 4.25 bits. Document: spec/4bit.md."""

from kvzip_formats.compact.codec import CompactSpec

SPEC = CompactSpec(name="4bit", k_groups=((1.0, 4),), v_groups=((1.0, 4),), sink_tokens=1, version=1)
