"""Reference paged-cache ops (plain torch): the ground truth for kvzip-kernels.

Layout: ``spec/paged_layout.md``. ``cache_write`` scatters a format's encoded rows into the
paged cache through a slot mapping; ``paged_decode`` is decode attention on the dequantized
paged cache, in float32 (or in bf16: the "plain torch in the same dtype" twin that earns a
kernel's tolerance).
"""

from kvzip_formats.ops.cache_write import (
    PagedLayout,
    cache_write,
    check_paged_cache,
    gather_rows,
    new_paged_cache,
)
from kvzip_formats.ops.paged_decode import check_decode_inputs, paged_decode

__all__ = [
    "PagedLayout",
    "cache_write",
    "check_decode_inputs",
    "check_paged_cache",
    "gather_rows",
    "new_paged_cache",
    "paged_decode",
]
