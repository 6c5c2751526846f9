"""kvzip_lossless: bit-exact compression of the bf16 KV cache, on the CPU and the GPU.

>>> import torch, kvzip_lossless as kl
>>> x = torch.randn(256, 3, 64).bfloat16()
>>> torch.equal(kl.decompress(kl.compress(x)).view(torch.int16), x.view(torch.int16))
True
"""

from kvzip_lossless._version import __version__
from kvzip_lossless.batch import (
    PLAN_FIELDS,
    EncodedBatch,
    PreparedDecode,
    check_batch,
    decode_batch,
    encode_batch,
    plan_blobs,
    prepare_copies_nothing,
    prepare_decode_batch,
)
from kvzip_lossless.blob import FORMAT_VERSION, CorruptBlobError
from kvzip_lossless.codec import coder, compress, decompress
from kvzip_lossless.tables import Table, TableSet, build_kv_tables, fit_table, kv_slot

__all__ = [
    "FORMAT_VERSION",
    "PLAN_FIELDS",
    "EncodedBatch",
    "PreparedDecode",
    "CorruptBlobError",
    "Table",
    "TableSet",
    "__version__",
    "build_kv_tables",
    "check_batch",
    "coder",
    "compress",
    "decode_batch",
    "decompress",
    "encode_batch",
    "fit_table",
    "kv_slot",
    "plan_blobs",
    "prepare_copies_nothing",
    "prepare_decode_batch",
]
