"""Distribution strategies behind one small interface, and the layout they run on."""

from raytrain_ext.parallel.dims import ParallelDims, ParallelLayoutError, dims_for_run
from raytrain_ext.parallel.strategy import DistContext, Strategy

__all__ = [
    "DistContext",
    "ParallelDims",
    "ParallelLayoutError",
    "Strategy",
    "dims_for_run",
]
