"""The NCCL settings in effect on a node, and checks for known-bad combinations.

NCCL reads its variables from the process environment first, then
``NCCL_CONF_FILE`` or ``~/.nccl.conf``, then ``/etc/nccl.conf`` (a file never
overrides an earlier source), so a value can come from a file nobody
remembers.  :func:`nccl_settings` reproduces that precedence and records the
source.  The checks are pure functions of explicit inputs (settings,
interface names, IB port states, NVLink count) so they are tested without a
cluster; the node probe gathers the inputs.

Interface lists follow NCCL's own matching (``NCCL_SOCKET_IFNAME``,
``NCCL_IB_HCA``): comma-separated entries; a leading ``^`` excludes the
listed entries instead of selecting them; a leading ``=`` (after any ``^``)
asks for exact names instead of prefixes; ``:port`` suffixes are ignored
here.  ``NCCL_SOCKET_IFNAME=eth`` therefore selects ``eth0`` and ``eth1``.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from raytrain_ext.ops.doctor.findings import finding

KEY_VARIABLES = (
    "NCCL_IB_DISABLE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_P2P_LEVEL",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_NET",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_CROSS_NIC",
    "NCCL_IB_GID_INDEX",
    "NCCL_NVLS_ENABLE",
    "NCCL_BUFFSIZE",
    "NCCL_NTHREADS",
)
# NCCL's path type names (topoPathTypeStr in graph/topo.cc, 2.2x); the docs list the first six
# common ones for NCCL_P2P_LEVEL / NCCL_NET_GDR_LEVEL, and NCCL also accepts the legacy integers.
TOPOLOGY_LEVELS = (
    "LOC",
    "NVL",
    "PIX",
    "PXB",
    "PHB",
    "SYS",
    "NVB",
    "C2C",
    "P2C",
    "PXN",
    "NET",
    "DIS",
)
DEFAULT_SOCKET_IFNAME = "^docker,lo"


def parse_conf(text: str) -> Dict[str, str]:
    """``KEY=VALUE`` lines of an nccl.conf; ``#`` comments and blank lines skipped."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def nccl_settings(
    environ: Dict[str, str], conf_files: Sequence[Tuple[str, str]]
) -> Dict[str, dict]:
    """``{VAR: {"value", "source"}}`` for every NCCL_* set; ``conf_files`` in NCCL's read order."""
    settings = {
        k: {"value": v, "source": "environment"}
        for k, v in environ.items()
        if k.startswith("NCCL_")
    }
    for path, text in conf_files:
        for key, value in parse_conf(text).items():
            if key.startswith("NCCL_") and key not in settings:
                settings[key] = {"value": value, "source": path}
    return dict(sorted(settings.items()))


def parse_if_list(spec: str) -> Tuple[bool, bool, List[str]]:
    """(exclude, exact, names) for an NCCL interface list such as ``^=docker0,lo``."""
    exclude = spec.startswith("^")
    rest = spec[1:] if exclude else spec
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    names = [entry.split(":", 1)[0].strip() for entry in rest.split(",") if entry.strip()]
    return exclude, exact, names


def match_interfaces(spec: str, interfaces: Iterable[str]) -> List[str]:
    """The interfaces NCCL would consider under ``spec`` (in the given order)."""
    exclude, exact, names = parse_if_list(spec)

    def listed(name: str) -> bool:
        return any(name == n if exact else name.startswith(n) for n in names)

    return [i for i in interfaces if listed(i) != exclude]


def _truthy(value: Optional[str]) -> bool:
    return value is not None and value.strip() not in ("", "0")


def _valid_level(value: str) -> bool:
    return value.upper() in TOPOLOGY_LEVELS or value.strip().isdigit()


def check_nccl_env(
    values: Dict[str, str],
    *,
    interfaces: Sequence[str],
    ib_ports: Dict[str, List[str]],
    nvlink_active: int,
    gpu_count: int,
    n_nodes: int,
) -> List[dict]:
    """Findings for one node.

    ``values`` maps NCCL_* to its value; ``interfaces`` are the node's network
    interface names; ``ib_ports`` maps each /sys/class/infiniband device to its
    port states (``ACTIVE``, ``DOWN``...); ``nvlink_active`` counts active
    NVLinks over all GPUs; ``n_nodes`` is the cluster size.
    """
    active_ib = sorted(d for d, states in ib_ports.items() if "ACTIVE" in states)
    out = _network_checks(values, interfaces, ib_ports, active_ib, n_nodes, gpu_count)
    out += _intra_node_checks(values, nvlink_active, gpu_count)
    debug = values.get("NCCL_DEBUG", "").upper()
    if debug in ("INFO", "TRACE"):
        out.append(
            finding(
                "info",
                "NCCL_DEBUG",
                f"NCCL_DEBUG={debug} logs every communicator "
                "init on every rank; unset it outside debugging",
            )
        )
    for var in ("NCCL_ALGO", "NCCL_PROTO"):
        if values.get(var):
            out.append(
                finding(
                    "info",
                    var,
                    f"{var}={values[var]} overrides NCCL's tuning; "
                    "remove it unless a benchmark showed it helps",
                )
            )
    return out


def _network_checks(values, interfaces, ib_ports, active_ib, n_nodes, gpu_count) -> List[dict]:
    out = _transport_checks(values, ib_ports, active_ib, n_nodes, gpu_count)
    out += _socket_ifname_checks(values.get("NCCL_SOCKET_IFNAME"), interfaces, n_nodes)
    return out + _selector_checks(values, ib_ports)


def _transport_checks(values, ib_ports, active_ib, n_nodes, gpu_count) -> List[dict]:
    """Whether NCCL will use the IB/RoCE devices this node has, or TCP sockets."""
    out = []
    if _truthy(values.get("NCCL_IB_DISABLE")) and active_ib:
        out.append(
            finding(
                "warning",
                "NCCL_IB_DISABLE",
                f"NCCL_IB_DISABLE={values['NCCL_IB_DISABLE']} but this node has active "
                f"IB/RoCE devices ({', '.join(active_ib)}): NCCL will use TCP sockets "
                "between nodes; unset NCCL_IB_DISABLE",
            )
        )
    net = values.get("NCCL_NET", "")
    if net.lower() == "socket" and active_ib:
        out.append(
            finding(
                "warning",
                "NCCL_NET",
                f"NCCL_NET=Socket forces TCP although IB/RoCE "
                f"devices are active ({', '.join(active_ib)})",
            )
        )
    if net.upper() == "IB" and not active_ib:
        out.append(
            finding(
                "error",
                "NCCL_NET",
                "NCCL_NET=IB but no IB/RoCE port is ACTIVE on this "
                "node: communicator init will fail",
            )
        )
    if ib_ports and not active_ib:
        out.append(
            finding(
                "warning",
                "infiniband",
                f"IB/RoCE devices present ({', '.join(sorted(ib_ports))}) "
                "but no port is ACTIVE (check cabling / subnet manager)",
            )
        )
    if not ib_ports and n_nodes > 1 and gpu_count > 0:
        out.append(
            finding(
                "info",
                "infiniband",
                "no IB/RoCE devices in /sys/class/infiniband: NCCL "
                "will use TCP sockets between nodes",
            )
        )
    return out


def _selector_checks(values, ib_ports) -> List[dict]:
    """``NCCL_IB_HCA`` and ``NCCL_NET_GDR_LEVEL`` name things that exist."""
    out = []
    hca = values.get("NCCL_IB_HCA")
    if hca and not match_interfaces(hca, sorted(ib_ports)):
        out.append(
            finding(
                "error",
                "NCCL_IB_HCA",
                f"NCCL_IB_HCA={hca} selects none of this node's IB "
                f"devices ({', '.join(sorted(ib_ports)) or 'none'})",
            )
        )
    gdr = values.get("NCCL_NET_GDR_LEVEL")
    if gdr and not _valid_level(gdr):
        out.append(
            finding(
                "error",
                "NCCL_NET_GDR_LEVEL",
                f"NCCL_NET_GDR_LEVEL={gdr} is not one of "
                f"{', '.join(TOPOLOGY_LEVELS[:6])} (or another "
                "NCCL path type, or a number)",
            )
        )
    return out


def _socket_ifname_checks(
    spec: Optional[str], interfaces: Sequence[str], n_nodes: int
) -> List[dict]:
    if not spec:
        return []
    matched = match_interfaces(spec, interfaces)
    if not matched:
        return [
            finding(
                "error",
                "NCCL_SOCKET_IFNAME",
                f"NCCL_SOCKET_IFNAME={spec} matches no interface on this node (interfaces: "
                f"{', '.join(interfaces) or 'none'}); NCCL init will fail with 'no socket "
                "interface found'. Use a name or prefix that exists here",
            )
        ]
    if n_nodes > 1 and all(i == "lo" for i in matched):
        return [
            finding(
                "error",
                "NCCL_SOCKET_IFNAME",
                f"NCCL_SOCKET_IFNAME={spec} selects only the loopback interface, which "
                "cannot reach other nodes",
            )
        ]
    return []


def _intra_node_checks(values, nvlink_active: int, gpu_count: int) -> List[dict]:
    out = []
    p2p_off = _truthy(values.get("NCCL_P2P_DISABLE"))
    if p2p_off and nvlink_active:
        out.append(
            finding(
                "warning",
                "NCCL_P2P_DISABLE",
                f"NCCL_P2P_DISABLE={values['NCCL_P2P_DISABLE']} on a node with "
                f"{nvlink_active} active NVLinks: GPU-to-GPU traffic goes through host "
                "memory instead of NVLink",
            )
        )
    elif p2p_off and gpu_count > 1:
        out.append(
            finding(
                "info",
                "NCCL_P2P_DISABLE",
                "NCCL_P2P_DISABLE is set: intra-node GPU traffic goes through host memory",
            )
        )
    level = values.get("NCCL_P2P_LEVEL")
    if level and not _valid_level(level):
        out.append(
            finding(
                "error",
                "NCCL_P2P_LEVEL",
                f"NCCL_P2P_LEVEL={level} is not one of "
                f"{', '.join(TOPOLOGY_LEVELS[:6])} (or another "
                "NCCL path type, or a number)",
            )
        )
    elif level and level.upper() == "LOC" and gpu_count > 1:
        out.append(
            finding(
                "warning",
                "NCCL_P2P_LEVEL",
                "NCCL_P2P_LEVEL=LOC disables GPU peer-to-peer between all GPUs",
            )
        )
    if (
        _truthy(values.get("NCCL_SHM_DISABLE"))
        and (p2p_off or nvlink_active == 0)
        and gpu_count > 1
    ):
        out.append(
            finding(
                "warning",
                "NCCL_SHM_DISABLE",
                "NCCL_SHM_DISABLE is set and P2P is "
                "unavailable: intra-node traffic goes "
                "through the network stack",
            )
        )
    return out
