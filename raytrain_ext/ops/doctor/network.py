"""A node's network as NCCL and gloo see it: interfaces, RDMA ports, error counters.

Readers take their root directory or file text as an argument so tests feed
them fixtures; evaluation is separate and pure.  Counters are totals since
boot, so a non-zero value says "this has happened", not "this is happening";
the thresholds below flag ratios, not single events, for drops.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from raytrain_ext.ops.doctor.findings import finding

RX_COLUMNS = ("bytes", "packets", "errs", "drop", "fifo", "frame", "compressed", "multicast")
TX_COLUMNS = ("bytes", "packets", "errs", "drop", "fifo", "colls", "carrier", "compressed")
DROP_RATIO_WARN = 1e-3  # dropped / packets above this is more than background noise
IB_ERROR_COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
)


def parse_proc_net_dev(text: str) -> Dict[str, Dict[str, int]]:
    """``/proc/net/dev`` -> ``{iface: {"rx_bytes": .., "tx_drop": .., ...}}``.

    The interface name ends at the colon; large counters may touch it
    (``ens1f0:98765432100``), so split on the colon, not on whitespace.
    """
    out = {}
    for line in text.splitlines():
        if ":" not in line or "|" in line:
            continue
        name, _, rest = line.partition(":")
        values = [int(v) for v in rest.split()]
        if len(values) < len(RX_COLUMNS) + len(TX_COLUMNS):
            continue
        row = {f"rx_{c}": v for c, v in zip(RX_COLUMNS, values, strict=False)}
        row.update(
            {f"tx_{c}": v for c, v in zip(TX_COLUMNS, values[len(RX_COLUMNS) :], strict=False)}
        )
        out[name.strip()] = row
    return out


def net_dev_problems(counters: Dict[str, Dict[str, int]]) -> List[dict]:
    """Errors on any interface; drops above :data:`DROP_RATIO_WARN` of packets."""
    out = []
    for name, c in counters.items():
        errors = {
            k: c[k]
            for k in ("rx_errs", "tx_errs", "rx_frame", "tx_carrier", "rx_fifo", "tx_fifo")
            if c.get(k)
        }
        if errors:
            shown = ", ".join(f"{k}={v}" for k, v in errors.items())
            out.append(finding("warning", "net_dev", f"{name}: error counters since boot: {shown}"))
        for side in ("rx", "tx"):
            packets, drops = c.get(f"{side}_packets", 0), c.get(f"{side}_drop", 0)
            if drops and packets and drops / packets > DROP_RATIO_WARN:
                out.append(
                    finding(
                        "warning",
                        "net_dev",
                        f"{name}: {side} dropped {drops} of {packets} "
                        f"packets ({100 * drops / packets:.2f}%)",
                    )
                )
    return out


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_interfaces(sys_net: str = "/sys/class/net") -> List[dict]:
    """Interfaces with state, speed (Mb/s, None when unknown), MTU and IPv4/IPv6 addresses."""
    addresses = _addresses()
    out = []
    root = Path(sys_net)
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        speed = _read(entry / "speed")
        out.append(
            {
                "name": entry.name,
                "state": _read(entry / "operstate"),
                "speed_mbps": int(speed)
                if speed and speed.lstrip("-").isdigit() and int(speed) > 0
                else None,
                "mtu": int(_read(entry / "mtu") or 0) or None,
                "addresses": addresses.get(entry.name, []),
            }
        )
    return out


def _addresses() -> Dict[str, List[str]]:
    try:
        import psutil
    except ImportError:
        return {}
    import socket

    return {
        name: [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        for name, addrs in psutil.net_if_addrs().items()
    }


def read_infiniband(root: str = "/sys/class/infiniband") -> Dict[str, dict]:
    """``{device: {"ports": {port: {"state", "phys_state", "rate", "link_layer", "counters"}}}}``.

    ``state`` is normalized from sysfs' ``4: ACTIVE`` to ``ACTIVE``; counters
    are the error counters of :data:`IB_ERROR_COUNTERS` that are readable.
    """
    out: Dict[str, dict] = {}
    base = Path(root)
    if not base.is_dir():
        return out
    for dev in sorted(base.iterdir()):
        ports = {}
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            counters = {}
            for name in IB_ERROR_COUNTERS:
                value = _read(port / "counters" / name)
                if value is not None and value.isdigit():
                    counters[name] = int(value)
            ports[port.name] = {
                "state": (_read(port / "state") or "").split(":")[-1].strip() or None,
                "phys_state": (_read(port / "phys_state") or "").split(":")[-1].strip() or None,
                "rate": _read(port / "rate"),
                "link_layer": _read(port / "link_layer"),
                "counters": counters,
            }
        out[dev.name] = {"ports": ports}
    return out


def ib_port_states(ib: Dict[str, dict]) -> Dict[str, List[str]]:
    return {
        dev: [p["state"] or "UNKNOWN" for p in info["ports"].values()] for dev, info in ib.items()
    }


def infiniband_problems(ib: Dict[str, dict]) -> List[dict]:
    out = []
    for dev, info in ib.items():
        for port, p in info["ports"].items():
            if p["state"] != "ACTIVE":
                out.append(
                    finding(
                        "warning",
                        "infiniband",
                        f"{dev} port {port} is {p['state'] or 'unknown'} "
                        f"(physical: {p['phys_state'] or 'unknown'})",
                    )
                )
            bad = {k: v for k, v in p["counters"].items() if v}
            if bad:
                shown = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
                out.append(
                    finding("warning", "infiniband", f"{dev} port {port} error counters: {shown}")
                )
    return out


def read_proc_net_dev(path: str = "/proc/net/dev") -> Dict[str, Dict[str, int]]:
    return parse_proc_net_dev(Path(path).read_text()) if os.path.exists(path) else {}
