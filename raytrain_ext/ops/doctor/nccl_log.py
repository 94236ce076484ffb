"""Parse NCCL_DEBUG=INFO logs into the transports NCCL actually chose.

NCCL decides at communicator init, per peer and per channel, whether bytes
travel over NVLink/PCIe (P2P), host shared memory (SHM), InfiniBand/RoCE
(NET/IB) or TCP (NET/Socket), and the only record of that choice is its INFO
log.  The parser is a pure function over log text (one or many ranks' files
concatenated) so it is tested on fixture logs in the exact format NCCL 2.18-2.23
prints, e.g.::

    gpu-a:21001:21088 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA
    gpu-a:21001:21088 [0] NCCL INFO Channel 00/02 :    0   1   2   3
    gpu-a:21001:21088 [0] NCCL INFO Using network IB

Older releases (2.4-2.7) print ``Ring 00 : 3[b01000] -> 4[201000] [send] via
NET/Socket/0`` with bus ids in brackets; both forms are accepted.  A connection
is reported once even though both its sender and its receiver log it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Set, Tuple

PREFIX = re.compile(
    r"^(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"(?:\S+:\d+ )?NCCL (?P<level>INFO|WARN|TRACE|ABORT) (?P<msg>.*)$"
)
CONNECTION = re.compile(
    r"^(?:Channel|Ring) (?P<channel>\d+)(?:/\d+)? : (?P<src>\d+)(?:\[[0-9a-fA-Fx]+\])? -> "
    r"(?P<dst>\d+)(?:\[[0-9a-fA-Fx]+\])?(?: \[(?P<direction>send|receive)\])? via (?P<via>\S.*?)\s*$"
)
RING_ORDER = re.compile(r"^Channel (?P<channel>\d+)/(?P<total>\d+) :(?P<ranks>(?:\s+\d+)+)\s*$")
RING_NEIGHBOURS = re.compile(r"^Ring (?P<channel>\d+) : (?P<path>-?\d+(?: -> -?\d+)+)\s*$")
COMM = re.compile(
    r"comm 0x[0-9a-fA-F]+ rank (?P<rank>\d+) n[Rr]anks (?P<nranks>\d+)"
    r"(?: nNodes (?P<nnodes>\d+))?"
)
NET_USING = re.compile(r"^NET/(?P<net>IB|Socket) : Using (?P<devices>.+)$")
DEVICE = re.compile(r"\[(?P<index>\d+)\](?P<name>[^\s;]+)")
USING_NETWORK = re.compile(r"^Using network (?P<net>.+?)\s*$")
VERSION = re.compile(r"NCCL version (?P<version>\d+\.\d+\.\d+\S*)")


@dataclass(frozen=True)
class Transport:
    """One ``via ...`` string, classified.

    ``family`` is what an operator cares about: ``NET/IB`` (InfiniBand or
    RoCE verbs, including the IBext plugin), ``NET/Socket`` (TCP), ``NET/<plugin>``,
    ``P2P`` (NVLink or PCIe peer access), ``SHM`` (through host memory),
    ``CollNet`` or ``NVLS``; ``gdr`` is GPUDirect RDMA on a network path.
    """

    family: str
    detail: str
    gdr: bool

    @property
    def label(self) -> str:
        return f"{self.family}{'/' + self.detail if self.detail else ''}"


def classify_transport(via: str) -> Transport:
    parts = via.split("/")
    gdr = "GDRDMA" in parts
    if parts[0] == "NET" and len(parts) > 1:
        net = parts[1]
        family = "NET/IB" if net.startswith("IB") else f"NET/{net}"
        return Transport(family, "GDRDMA" if gdr else "", gdr)
    if parts[0] == "P2P":
        return Transport("P2P", "/".join(parts[1:]), False)
    if parts[0] == "SHM":
        return Transport("SHM", "", False)
    return Transport(parts[0], "/".join(parts[1:]), gdr)


@dataclass(frozen=True)
class Connection:
    channel: int
    src: int
    dst: int
    via: str


@dataclass
class NcclLog:
    """What one communicator's logs say.  ``rank_hosts`` maps rank -> host name."""

    version: Optional[str] = None
    networks: List[str] = field(default_factory=list)
    net_devices: Dict[str, List[str]] = field(default_factory=dict)
    ib_missing: bool = False
    rank_hosts: Dict[int, str] = field(default_factory=dict)
    nranks: Optional[int] = None
    nnodes: Optional[int] = None
    connections: List[Connection] = field(default_factory=list)
    rings: Dict[int, List[int]] = field(default_factory=dict)
    ring_neighbours: Dict[int, Dict[int, Tuple[int, int]]] = field(default_factory=dict)
    connected_all_rings: bool = False
    connected_all_trees: bool = False
    warnings: List[str] = field(default_factory=list)
    lines: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["connections"] = [asdict(c) for c in self.connections]
        d["peers"] = peer_transports(self)
        return d


def parse_nccl_log(text: str) -> NcclLog:
    """Parse NCCL INFO/WARN lines; lines in any other format are ignored."""
    log = NcclLog()
    seen: Set[Tuple[int, int, int, str]] = set()
    for raw in text.splitlines():
        version = VERSION.search(raw)
        if version and log.version is None:
            log.version = version.group("version")
        m = PREFIX.match(raw.strip())
        if not m:
            continue
        log.lines += 1
        msg = m.group("msg").strip()
        if m.group("level") == "WARN":
            log.warnings.append(f"{m.group('host')}: {msg}")
            continue
        _parse_message(log, m.group("host"), msg, seen)
    for channel, hops in log.ring_neighbours.items():
        log.rings.setdefault(channel, ring_from_neighbours(hops))
    return log


def ring_from_neighbours(hops: Dict[int, Tuple[int, int]]) -> List[int]:
    """Ring order from per-rank (prev, next) pairs, starting at the lowest rank; stops at a gap."""
    start = min(hops)
    order = [start]
    while True:
        nxt = hops[order[-1]][1]
        if nxt == start or nxt in order or nxt not in hops:
            return order
        order.append(nxt)


def _parse_message(log: NcclLog, host: str, msg: str, seen: Set[Tuple[int, int, int, str]]) -> None:
    conn = CONNECTION.match(msg)
    if conn:
        key = (int(conn["channel"]), int(conn["src"]), int(conn["dst"]), conn["via"])
        if key not in seen:
            seen.add(key)
            log.connections.append(Connection(*key))
        return
    ring = RING_ORDER.match(msg)
    if ring:
        log.rings[int(ring["channel"])] = [int(r) for r in ring["ranks"].split()]
        return
    hop = RING_NEIGHBOURS.match(msg)
    if hop:
        path = [int(r) for r in hop["path"].split(" -> ")]
        if len(path) == 3:  # "prev -> me -> next", as each rank logs its place in the ring
            log.ring_neighbours.setdefault(int(hop["channel"]), {})[path[1]] = (path[0], path[2])
        return
    comm = COMM.search(msg)
    if comm:
        log.rank_hosts[int(comm["rank"])] = host
        log.nranks = int(comm["nranks"])
        if comm["nnodes"]:
            log.nnodes = int(comm["nnodes"])
        return
    net = NET_USING.match(msg)
    if net:
        names = [d["name"] for d in DEVICE.finditer(net["devices"].split(";")[0])]
        known = log.net_devices.setdefault(net["net"], [])
        known.extend(n for n in names if n not in known)
        return
    using = USING_NETWORK.match(msg)
    if using and using["net"] not in log.networks:
        log.networks.append(using["net"])
    elif msg.startswith("NET/IB : No device found"):
        log.ib_missing = True
    elif msg == "Connected all rings":
        log.connected_all_rings = True
    elif msg == "Connected all trees":
        log.connected_all_trees = True


def peer_transports(log: NcclLog) -> List[dict]:
    """One row per (src, dst) pair: the transport families used and on how many channels."""
    rows: Dict[Tuple[int, int], dict] = {}
    for c in log.connections:
        t = classify_transport(c.via)
        row = rows.setdefault(
            (c.src, c.dst),
            {
                "src": c.src,
                "dst": c.dst,
                "src_host": log.rank_hosts.get(c.src),
                "dst_host": log.rank_hosts.get(c.dst),
                "transports": [],
                "channels": set(),
            },
        )
        if t.label not in row["transports"]:
            row["transports"].append(t.label)
        row["channels"].add(c.channel)
    out = []
    for key in sorted(rows):
        row = rows[key]
        out.append({**row, "channels": len(row["channels"])})
    return out


def _socket_fallback(log: NcclLog) -> Tuple[str, str]:
    """The warning for rank pairs that talk over TCP sockets, naming them and why."""
    pairs = sorted(
        {
            (c.src, c.dst)
            for c in log.connections
            if classify_transport(c.via).family == "NET/Socket"
        }
    )
    shown = ", ".join(f"{s}->{d}" for s, d in pairs[:8]) + (" ..." if len(pairs) > 8 else "")
    why = (
        "IB/RoCE devices were found but not used (check NCCL_IB_DISABLE, NCCL_NET, NCCL_IB_HCA)"
        if log.net_devices.get("IB")
        else "no usable IB/RoCE device"
    )
    return (
        "warning",
        f"NCCL fell back to TCP sockets (NET/Socket) between nodes for "
        f"{len(pairs)} rank pairs ({shown}); {why}",
    )


def transport_verdict(log: NcclLog) -> List[Tuple[str, str]]:
    """(severity, sentence) pairs an operator can act on, most important first."""
    if not log.connections:
        return [
            (
                "warning",
                "the NCCL log has no 'Channel ... via ...' lines: set "
                "NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,NET before NCCL initializes",
            )
        ]
    families = {classify_transport(c.via) for c in log.connections}
    names = {t.family for t in families}
    out: List[Tuple[str, str]] = []
    if "NET/Socket" in names:
        out.append(_socket_fallback(log))
    ib = [t for t in families if t.family == "NET/IB"]
    if ib:
        if all(t.gdr for t in ib):
            out.append(
                (
                    "ok",
                    "inter-node traffic uses InfiniBand/RoCE with GPUDirect RDMA (NET/IB .../GDRDMA)",
                )
            )
        else:
            out.append(
                (
                    "warning",
                    "inter-node traffic uses InfiniBand/RoCE without GPUDirect RDMA on some "
                    "channels: data is staged through host memory (check nvidia-peermem / "
                    "NCCL_NET_GDR_LEVEL)",
                )
            )
    if "SHM" in names:
        out.append(
            (
                "info",
                "some intra-node peers communicate through host shared memory (SHM): "
                "GPU peer-to-peer is unavailable or disabled between them",
            )
        )
    if "P2P" in names:
        out.append(("ok", "intra-node traffic uses GPU peer-to-peer (P2P over NVLink or PCIe)"))
    if not log.connected_all_rings:
        out.append(
            (
                "warning",
                "the log never says 'Connected all rings': initialization may not have finished",
            )
        )
    return out
