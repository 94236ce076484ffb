"""Record a torch.profiler trace of training steps ``profile.steps = [a, b]`` on chosen ranks.

The training loop calls ``step_begin(step)`` before and ``step_end(step)`` after
each step (steps count from 1, as in the metrics records) and ``close()`` when
it stops.  On a rank in ``profile.ranks`` the profiler starts right before step
``a``, wraps every step in a ``ProfilerStep#<step>`` range (the name torch's
own ``profile.step()`` emits, which the TensorBoard plugin and HTA split steps
by), stops after step ``b`` and writes ``<dir>/rank<r>-steps<a>-<b>.json`` in
Chrome trace format (open it in https://ui.perfetto.dev).  The label is the
loop's own step number, so the trace lines up with the metrics, also after a
resume from a checkpoint.

Everywhere else (profiling off, another rank, steps outside the range) each
call costs one comparison.  A run that stops inside the range (preemption,
``run.max_steps < b``) still gets its trace, and one that resumes inside it
records from its first step: the file name gives the steps actually recorded.
A recovery that redoes the range writes it again; the later trace replaces the
earlier one.

``RAYTRAIN_EXT_PROFILER=nsys`` in the workers' environment uses the same step
range for Nsight Systems instead: ``torch.cuda.profiler.start()`` before step
``a`` and ``stop()`` after step ``b`` (for ``nsys profile
--capture-range=cudaProfilerApi``) and one NVTX range per step.  CUPTI serves
one profiler at a time, so the two modes are exclusive.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

TOOL_ENV = "RAYTRAIN_EXT_PROFILER"
TOOLS = ("torch", "nsys")
STEP_LABEL = "ProfilerStep#{}"


class StepProfiler:
    """Profiles steps ``first..last`` (inclusive) on the listed ranks; a no-op elsewhere."""

    def __init__(
        self,
        profile_cfg,
        rank: int,
        device: Optional[torch.device] = None,
        tool: Optional[str] = None,
    ):
        steps = list(profile_cfg.steps)
        self.rank = rank
        self.enabled = bool(steps) and rank in list(profile_cfg.ranks)
        self.first: int = steps[0] if steps else 0
        self.last: int = steps[1] if steps else -1
        self.dir = Path(profile_cfg.dir)
        self.record_shapes = bool(profile_cfg.record_shapes)
        self.with_stack = bool(profile_cfg.with_stack)
        self.device = device or torch.device("cpu")
        self.tool = tool or os.environ.get(TOOL_ENV, "torch")
        if self.tool not in TOOLS:
            raise ValueError(f"{TOOL_ENV}={self.tool!r}: choose one of {', '.join(TOOLS)}")
        if self.enabled and self.tool == "nsys" and self.device.type != "cuda":
            raise ValueError(
                f"{TOOL_ENV}=nsys profiles CUDA devices, but rank {rank} trains on "
                f"{self.device}; unset {TOOL_ENV} for a torch.profiler trace"
            )
        self.trace_path: Optional[Path] = None  # the written trace (torch mode)
        self._profiler: Optional[torch.profiler.profile] = None
        self._step_range: Optional[contextlib.AbstractContextManager] = None
        self._recording = False
        self._done = False  # one trace per process: a rollback that replays steps adds none
        self._first_recorded = self._last_recorded = 0

    def step_begin(self, step: int) -> None:
        if not self.enabled or self._done or not self.first <= step <= self.last:
            return
        if not self._recording:
            self._start()
            self._recording, self._first_recorded = True, step
        self._step_range = self._open_step_range(step)
        self._step_range.__enter__()

    def step_end(self, step: int) -> None:
        if self._step_range is None:
            return
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        self._last_recorded = step
        if step >= self.last:
            self._finish()

    def close(self) -> None:
        """Write what was recorded when the run stops inside the range; idempotent."""
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._recording:
            self._finish()

    def _start(self) -> None:
        if self.tool == "nsys":
            torch.cuda.profiler.start()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities, record_shapes=self.record_shapes, with_stack=self.with_stack
        )
        self._profiler.start()

    def _open_step_range(self, step: int) -> contextlib.AbstractContextManager:
        label = STEP_LABEL.format(step)
        if self.tool == "nsys":
            return torch.cuda.nvtx.range(label)
        return torch.profiler.record_function(label)

    def _finish(self) -> None:
        """Stop recording and write the trace (atomically: a reader never sees half a file)."""
        self._recording, self._done = False, True
        if self.tool == "nsys":  # nsys writes the report itself, named by its -o option
            torch.cuda.profiler.stop()
            return
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            raise RuntimeError("profiler: recording without a profiler")
        profiler.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        first, last = self._first_recorded, self._last_recorded or self._first_recorded
        path = self.dir / f"rank{self.rank}-steps{first}-{last}.json"
        partial = path.with_suffix(".json.partial")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, path)
        self.trace_path = path
        log.info("profiler: rank %d steps %d-%d -> %s", self.rank, first, last, path)
