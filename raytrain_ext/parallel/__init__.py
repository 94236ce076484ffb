"""Distribution strategies behind one small interface, and the layout they run on."""

from raytrain_ext.parallel.dims import ParallelDims, ParallelLayoutError, dims_for_run
from raytrain_ext.parallel.strategy import DistContext, Strategy, build_strategy

__all__ = ["DistContext", "ParallelDims", "ParallelLayoutError", "Strategy", "build_strategy",
           "dims_for_run"]
