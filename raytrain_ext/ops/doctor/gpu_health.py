"""GPU health from NVML readings: ECC, memory retirement, heat, power, clocks, XIDs.

Reading (:func:`read_gpus`) and judging (:func:`evaluate_gpu`) are separate:
the judge is a pure function of a readings dict, so the thresholds are
tested with fabricated readings.  A reading is ``None`` where NVML reports
"not supported" (consumer GPUs have no ECC counters, for example); ``None``
never makes a GPU unhealthy.

Thresholds (a GPU is *unhealthy* when any of these holds):

* volatile (since driver load) uncorrected ECC errors > 0;
* a row remapping failure, or an uncorrectable remapped row pending a reset;
* temperature >= the GPU's slowdown threshold (or >= 87 C when NVML does not
  report one), or an active hardware slowdown / thermal / power-brake clock event;
* a critical XID in the kernel log (:data:`CRITICAL_XIDS`).

It gets a *warning* for: aggregate (lifetime) uncorrected ECC errors,
retired pages or remaps pending a GPU reset, temperature within 5 C of
slowdown (or >= 80 C), software thermal slowdown, power draw above the
enforced limit, and any other XID.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional

from raytrain_ext.ops.doctor.findings import finding

HOT_DEFAULT_C = 87.0
WARM_DEFAULT_C = 80.0
WARM_MARGIN_C = 5.0
CLOCK_EVENT_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
SEVERE_CLOCK_EVENTS = ("hw_slowdown", "hw_thermal", "hw_power_brake")
CRITICAL_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    64: "row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
XID_LINE = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<xid>\d+),\s*(?P<detail>.*)")


def decode_clock_events(mask: int) -> List[str]:
    """NVML clocks-event (throttle) reason bit mask -> names."""
    return [name for bit, name in CLOCK_EVENT_BITS.items() if mask & bit]


def parse_xid_lines(text: str) -> List[dict]:
    """Kernel log lines ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``"""
    out = []
    for line in text.splitlines():
        m = XID_LINE.search(line)
        if m:
            out.append({"pci": m["pci"], "xid": int(m["xid"]), "detail": m["detail"].strip()})
    return out


def evaluate_gpu(r: Dict) -> Dict:
    """``{"status": "ok"|"warning"|"unhealthy", "problems": [finding, ...]}`` for one GPU's readings."""
    problems = _ecc_problems(r) + _thermal_problems(r) + _xid_problems(r.get("xids") or [])
    severities = {p["severity"] for p in problems}
    status = (
        "unhealthy" if "error" in severities else "warning" if "warning" in severities else "ok"
    )
    return {"status": status, "problems": problems}


def _ecc_problems(r: Dict) -> List[dict]:
    out = []
    if (r.get("ecc_volatile_uncorrected") or 0) > 0:
        out.append(
            finding(
                "error",
                "ecc",
                f"{r['ecc_volatile_uncorrected']} uncorrected ECC errors "
                "since the driver loaded: drain the node and reset the GPU",
            )
        )
    elif (r.get("ecc_aggregate_uncorrected") or 0) > 0:
        out.append(
            finding(
                "warning",
                "ecc",
                f"{r['ecc_aggregate_uncorrected']} uncorrected ECC errors over the GPU's lifetime",
            )
        )
    if r.get("remapped_rows_failure"):
        out.append(finding("error", "row_remap", "row remapping failed: the GPU needs service"))
    elif r.get("remapped_rows_pending") and (r.get("remapped_rows_uncorrectable") or 0) > 0:
        out.append(
            finding(
                "error",
                "row_remap",
                "an uncorrectable-error row remap is pending: reset the GPU before using it",
            )
        )
    elif r.get("remapped_rows_pending"):
        out.append(finding("warning", "row_remap", "a row remap is pending a GPU reset"))
    if r.get("retired_pages_pending"):
        out.append(
            finding(
                "warning",
                "retired_pages",
                "page retirement is pending a GPU reset "
                f"({r.get('retired_pages_dbe') or 0} double-bit, "
                f"{r.get('retired_pages_sbe') or 0} single-bit pages)",
            )
        )
    return out


def _thermal_problems(r: Dict) -> List[dict]:
    out = []
    temp, slowdown = r.get("temperature_c"), r.get("slowdown_temp_c")
    hot = slowdown if slowdown else HOT_DEFAULT_C
    warm = slowdown - WARM_MARGIN_C if slowdown else WARM_DEFAULT_C
    if temp is not None and temp >= hot:
        out.append(
            finding(
                "error",
                "temperature",
                f"{temp:.0f} C is at or above the slowdown "
                f"temperature ({hot:.0f} C): check cooling",
            )
        )
    elif temp is not None and temp >= warm:
        out.append(
            finding(
                "warning",
                "temperature",
                f"{temp:.0f} C is within {hot - temp:.0f} C of slowdown ({hot:.0f} C)",
            )
        )
    events = r.get("clock_events") or []
    severe = [e for e in events if e in SEVERE_CLOCK_EVENTS]
    if severe:
        out.append(
            finding(
                "error",
                "clocks",
                f"clocks held down by {', '.join(severe)} "
                f"(SM {r.get('sm_clock_mhz')} of {r.get('sm_clock_max_mhz')} MHz)",
            )
        )
    elif "sw_thermal" in events:
        out.append(
            finding(
                "warning", "clocks", "clocks reduced by the driver for temperature (sw_thermal)"
            )
        )
    power, limit = r.get("power_w"), r.get("power_limit_w")
    if power is not None and limit and power > limit * 1.02:
        out.append(
            finding("warning", "power", f"drawing {power:.0f} W over the {limit:.0f} W limit")
        )
    return out


def _xid_problems(xids: List[dict]) -> List[dict]:
    out = []
    for x in xids:
        what = CRITICAL_XIDS.get(x["xid"])
        if what:
            out.append(
                finding("error", "xid", f"XID {x['xid']} ({what}) at {x['pci']}: {x['detail']}")
            )
        else:
            out.append(finding("warning", "xid", f"XID {x['xid']} at {x['pci']}: {x['detail']}"))
    return out


def read_gpus() -> Dict:
    """NVML readings for every GPU on this node (NVML ignores CUDA_VISIBLE_DEVICES).

    ``{"driver", "gpus": [readings], "error", "detail"}``; ``error`` says why
    there are no readings ("no NVIDIA driver", "cannot read GPUs") and
    ``detail`` what NVML or the import said.
    """
    try:
        import pynvml
    except ImportError:
        return {
            "driver": None,
            "gpus": [],
            "error": "cannot read GPUs",
            "detail": "pynvml is not installed: pip install nvidia-ml-py",
        }
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"driver": None, "gpus": [], "error": "no NVIDIA driver", "detail": str(e)}
    try:
        driver = _try(pynvml.nvmlSystemGetDriverVersion)
        gpus = [_read_one(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
        return {"driver": driver, "gpus": gpus, "error": None, "detail": None}
    finally:
        pynvml.nvmlShutdown()


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported and friends: the reading is simply absent
        return None


def _read_one(nv, index: int) -> Dict:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    uncorrected, corrected = (
        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
    )
    remap = _try(nv.nvmlDeviceGetRemappedRows, h) or (None, None, None, None)
    events = _try(nv.nvmlDeviceGetCurrentClocksEventReasons, h)
    pci = _try(nv.nvmlDeviceGetPciInfo, h)
    return {
        "index": index,
        "name": _try(nv.nvmlDeviceGetName, h),
        "uuid": _try(nv.nvmlDeviceGetUUID, h),
        "pci_bus_id": getattr(pci, "busId", None) if pci else None,
        "temperature_c": _try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
        "slowdown_temp_c": _try(
            nv.nvmlDeviceGetTemperatureThreshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        ),
        "power_w": _watts(_try(nv.nvmlDeviceGetPowerUsage, h)),
        "power_limit_w": _watts(_try(nv.nvmlDeviceGetEnforcedPowerLimit, h)),
        "sm_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
        "sm_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
        "mem_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
        "mem_clock_max_mhz": _try(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM),
        "clock_events": decode_clock_events(events) if events is not None else None,
        "ecc_volatile_uncorrected": _try(
            nv.nvmlDeviceGetTotalEccErrors, h, uncorrected, nv.NVML_VOLATILE_ECC
        ),
        "ecc_aggregate_uncorrected": _try(
            nv.nvmlDeviceGetTotalEccErrors, h, uncorrected, nv.NVML_AGGREGATE_ECC
        ),
        "ecc_volatile_corrected": _try(
            nv.nvmlDeviceGetTotalEccErrors, h, corrected, nv.NVML_VOLATILE_ECC
        ),
        "retired_pages_dbe": _count(
            _try(
                nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            )
        ),
        "retired_pages_sbe": _count(
            _try(
                nv.nvmlDeviceGetRetiredPages,
                h,
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            )
        ),
        "retired_pages_pending": _try(nv.nvmlDeviceGetRetiredPagesPendingStatus, h),
        "remapped_rows_correctable": remap[0],
        "remapped_rows_uncorrectable": remap[1],
        "remapped_rows_pending": remap[2],
        "remapped_rows_failure": remap[3],
        "nvlink_active": _nvlinks(nv, h),
    }


def _watts(milliwatts: Optional[int]) -> Optional[float]:
    return milliwatts / 1000.0 if milliwatts is not None else None


def _count(pages) -> Optional[int]:
    return len(pages) if pages is not None else None


def _nvlinks(nv, h) -> int:
    active = 0
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        state = _try(nv.nvmlDeviceGetNvLinkState, h, link)
        if state is None:
            break
        active += int(state == nv.NVML_FEATURE_ENABLED)
    return active


def read_xids(path: str = "/dev/kmsg", max_records: int = 50_000) -> Dict:
    """XID lines from the kernel ring buffer: ``{"readable": bool, "xids": [...], "error": str|None}``.

    /dev/kmsg needs privileges on most hosts; an unreadable log is reported,
    not treated as healthy or unhealthy.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return {"readable": False, "xids": [], "error": f"{path}: {e.strerror}"}
    lines = []
    try:
        for _ in range(max_records):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the record was overwritten while reading; keep going
                continue
            if not record:
                break
            lines.append(record.decode("utf-8", "replace").split(";", 1)[-1])
    finally:
        os.close(fd)
    return {"readable": True, "xids": parse_xid_lines("\n".join(lines)), "error": None}
