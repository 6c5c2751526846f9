"""The compact formats ``4bit``, ``3.5bit`` and ``3bit`` (spec/4bit.md, 3.5bit.md, 3bit.md).

One shared codec (``codec.CompactFormat``) parametrised by a ``CompactSpec`` per format
module; the calibrated transform (``transform``), the row layout (``layout``) and the frozen
codebooks (``codebook``) are modules of their own.
"""

from __future__ import annotations

from kvzip_formats.base import register_format
from kvzip_formats.compact.codec import CompactFormat, CompactSpec
from kvzip_formats.compact.fmt_3bit import SPEC as SPEC_3BIT
from kvzip_formats.compact.fmt_3p5bit import SPEC as SPEC_3P5BIT
from kvzip_formats.compact.fmt_4bit import SPEC as SPEC_4BIT

SPECS = {s.name: s for s in (SPEC_4BIT, SPEC_3P5BIT, SPEC_3BIT)}


def _factory(spec: CompactSpec):
    def make(calibration=None) -> CompactFormat:
        return CompactFormat(spec, calibration)

    return make


for _spec in SPECS.values():
    register_format(_spec.name, _factory(_spec))

__all__ = ["SPECS", "CompactFormat", "CompactSpec"]
