"""Distribution strategies behind one small interface, and the layout they run on.

The names below are imported on first use: the driver's config checks need
``parallel.dims`` (pure arithmetic on the layout), and an eager ``strategy`` import
made every driver import torch and DCP before it could say anything about a config
(2 s of the command's 3.5 s before Ray started).
"""

from typing import TYPE_CHECKING

from raytrain_ext.lazy_exports import exporter

_EXPORTS = {
    "DistContext": "raytrain_ext.parallel.strategy",
    "Strategy": "raytrain_ext.parallel.strategy",
    "ParallelDims": "raytrain_ext.parallel.dims",
    "ParallelLayoutError": "raytrain_ext.parallel.dims",
    "dims_for_run": "raytrain_ext.parallel.dims",
}

if TYPE_CHECKING:
    from raytrain_ext.parallel.dims import ParallelDims, ParallelLayoutError, dims_for_run
    from raytrain_ext.parallel.strategy import DistContext, Strategy

__getattr__ = exporter(globals(), _EXPORTS)

__all__ = [
    "DistContext",
    "ParallelDims",
    "ParallelLayoutError",
    "Strategy",
    "dims_for_run",
]
