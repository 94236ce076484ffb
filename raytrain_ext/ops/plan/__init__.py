"""Memory planner: per-GPU memory of each parallel strategy and a recommended layout.

Pure arithmetic (no Ray, no processes): :mod:`.shape` counts parameters,
:mod:`.memory` turns a layout into bytes, :mod:`.evaluation` checks the fit,
:mod:`.layout` picks the layout, :mod:`.cli` is ``raytrain-ext plan``.
"""

from raytrain_ext.ops.plan.cluster import Cluster, Settings
from raytrain_ext.ops.plan.layout import Plan, make_plan
from raytrain_ext.ops.plan.shape import (
    ModelShape,
    PlanError,
    count_params,
    infer_shape,
    shape_from_config,
)

__all__ = [
    "Cluster",
    "ModelShape",
    "Plan",
    "PlanError",
    "Settings",
    "count_params",
    "infer_shape",
    "make_plan",
    "shape_from_config",
]
