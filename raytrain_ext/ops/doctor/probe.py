"""What one node reports about itself: software versions, GPUs, NCCL settings, network.

:func:`probe_node` runs inside a Ray task pinned to the node (it must read
that node's /sys, /proc and NVML) and returns only plain data.  It never
raises for a missing piece: a section that cannot be read says why.  Ray
hides GPUs from a task that did not ask for one (``CUDA_VISIBLE_DEVICES=""``),
so GPUs are counted with NVML, which ignores that variable, and torch is only
asked for its build versions.
"""

from __future__ import annotations

import os
import platform
import re
import socket
from pathlib import Path
from typing import Any, Dict, List

from raytrain_ext.ops.doctor import gpu_health, network
from raytrain_ext.ops.doctor.nccl_env import nccl_settings

CONF_FILES = ("~/.nccl.conf", "/etc/nccl.conf")


def software_versions() -> Dict[str, str]:
    import ray
    import torch

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "cuda": torch.version.cuda or "none (CPU build)",
    }
    try:
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # a CPU build of torch has no NCCL to ask
        versions["nccl"] = "none (torch built without NCCL)"
    return versions


def _conf_files(environ: Dict[str, str]) -> List[tuple]:
    paths = [environ["NCCL_CONF_FILE"]] if environ.get("NCCL_CONF_FILE") else [CONF_FILES[0]]
    out = []
    for raw in [*paths, CONF_FILES[1]]:
        path = Path(raw).expanduser()
        try:
            out.append((str(path), path.read_text()))
        except OSError:
            continue
    return out


def same_pci_device(xid_pci: str, bus_id: str) -> bool:
    """``PCI:0000:3b:00`` (kernel log) vs ``00000000:3B:00.0`` (NVML): compare bus:device."""

    def bus_dev(text: str) -> str:
        parts = re.findall(r"[0-9a-fA-F]+", text.replace("PCI", ""))
        return (
            ":".join(p.lower().lstrip("0") or "0" for p in parts[1:3]) if len(parts) >= 3 else text
        )

    return bool(bus_id) and bus_dev(xid_pci) == bus_dev(bus_id)


def probe_node() -> Dict:
    """Everything the doctor needs from this node, as JSON-ready data."""
    import ray

    environ = dict(os.environ)
    gpus = gpu_health.read_gpus()
    xids: Dict[str, Any] = (
        gpu_health.read_xids()
        if gpus["gpus"]
        else {"readable": False, "xids": [], "error": "no GPU"}
    )
    for g in gpus["gpus"]:
        g["xids"] = [
            x for x in xids["xids"] if same_pci_device(x["pci"], g.get("pci_bus_id") or "")
        ]
    ib = network.read_infiniband()
    return {
        "hostname": socket.gethostname(),
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "kernel": platform.release(),
        "versions": software_versions(),
        "driver": gpus["driver"],
        "gpu_error": f"{gpus['error']} on node {ray.util.get_node_ip_address()} ({gpus['detail']})"
        if gpus["error"]
        else None,
        "gpus": gpus["gpus"],
        "xid_log": {k: v for k, v in xids.items() if k != "xids"},
        "nccl": nccl_settings(environ, _conf_files(environ)),
        "interfaces": network.read_interfaces(),
        "infiniband": ib,
        "net_dev": network.read_proc_net_dev(),
    }
