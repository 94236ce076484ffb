"""Integer Arrow arrays as numpy views, without pyarrow's pandas probe.

Why: ``pa.Array.to_numpy`` checks for pandas and imports it, which cost 0.1-0.3 s of
every rank's start here (measured with ``-X importtime``), though an integer array
without nulls needs no conversion: its values buffer already is the array.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def int_values(array: pa.Array) -> np.ndarray:
    """A read-only view of ``array``'s values (it keeps the Arrow buffer alive); an array
    with nulls goes through pyarrow's own conversion."""
    if array.null_count:
        return array.to_numpy(zero_copy_only=False)
    width = array.type.bit_width // 8
    kind = "u" if pa.types.is_unsigned_integer(array.type) else "i"
    return np.frombuffer(
        array.buffers()[1], dtype=f"{kind}{width}", count=len(array), offset=array.offset * width
    )
