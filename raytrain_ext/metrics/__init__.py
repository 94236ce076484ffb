"""Metric sinks: stdout progress lines, TensorBoard, ray.util.metrics."""

from raytrain_ext.metrics.sinks import (
    FanOut,
    MetricsSink,
    RayMetricsSink,
    StdoutSink,
    TensorBoardSink,
    format_progress,
    summarize_records,
)

__all__ = [
    "FanOut",
    "MetricsSink",
    "RayMetricsSink",
    "StdoutSink",
    "TensorBoardSink",
    "format_progress",
    "summarize_records",
]
