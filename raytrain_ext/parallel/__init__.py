"""Distribution strategies behind one small interface."""

from raytrain_ext.parallel.strategy import DistContext, Strategy, build_strategy

__all__ = ["DistContext", "Strategy", "build_strategy"]
