"""w6a8: asym_w4a8_int8 with uniform 6-bit codes (row width 3K/4 bytes).

Same format and code as w4a8 (see w4a8.py); codes c in 1..63 decode to c - 32,
no codebook, and each group's e4m3 scale is picked among its two neighbours by
least squared error through the int8 grid.
"""

from __future__ import annotations

from lowbit_pipe.formats.registry import register
from lowbit_pipe.formats.w4a8 import W4A8


@register
class W6A8(W4A8):
    name = "w6a8"
    bits_per_weight = 6.5
    bits = 6
