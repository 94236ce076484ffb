"""How long this process has run, on the kernel's clock.

A leaf (no Ray, no torch): the worker group tells a stocked process from a new one by it
(``worker.process_pool``), and a start's phases begin at a process's start
(``metrics.start_phases``; the torchrun reference reads it too).
"""

from __future__ import annotations

import os


def process_age_s() -> float:
    """Seconds since this process started, from the kernel's own clock (``/proc``: the
    start time in ticks since boot, against the uptime), precise to a tick; 0.0 where
    there is no ``/proc``."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return 0.0
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
