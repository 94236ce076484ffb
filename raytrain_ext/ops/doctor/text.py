"""The doctor report as text for a terminal: one section per concern, problems tagged.

A pure function of the report dict built by :mod:`raytrain_ext.ops.doctor.diagnosis`,
so whatever ``--json`` prints, the text says the same.  Problems are
prefixed ``[error]`` / ``[warning]`` / ``[info]`` so they can be grepped.
"""

from __future__ import annotations

from typing import Dict, List


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _tagged(findings: List[Dict], indent: str = "  ") -> List[str]:
    return [f"{indent}[{f['severity']}] {f['message']}" for f in findings]


def _node_name(n: Dict) -> str:
    return f"{n['node_ip']} ({n.get('hostname', '?')})"


def environment_lines(report: Dict) -> List[str]:
    out = ["== Environment"]
    for n in report["nodes"]:
        if "versions" not in n:
            out.append(f"node {n['node_ip']}: {n.get('error')}")
            continue
        v = n["versions"]
        models = sorted({g["name"] for g in n["gpus"]})
        gpus = f"{len(n['gpus'])} x {', '.join(models)}" if n["gpus"] else "none"
        out.append(
            f"node {_node_name(n)}: python {v['python']}, torch {v['torch']}, CUDA {v['cuda']}, "
            f"NCCL {v['nccl']}, ray {v['ray']}, driver {n.get('driver') or '-'}, GPUs {gpus}"
        )
        if n.get("gpu_error"):
            out.append(f"  {n['gpu_error']}")
    out += _tagged(report["mismatches"]) or ["  versions, driver and GPU models match across nodes"]
    return out


def nccl_settings_lines(report: Dict) -> List[str]:
    out = ["== NCCL settings (as the node's Ray workers see them)"]
    for n in report["nodes"]:
        if "nccl" not in n:
            continue
        shown = [
            f"{k}={v['value']}" + ("" if v["source"] == "environment" else f" (from {v['source']})")
            for k, v in n["nccl"].items()
        ]
        out.append(
            f"node {n['node_ip']}: {', '.join(shown) if shown else 'no NCCL_* variables set'}"
        )
        out += _tagged([f for f in n["findings"] if f["check"].startswith(("NCCL_", "infiniband"))])
    return out


def transport_lines(report: Dict) -> List[str]:
    t = report["transport"]
    out = ["== NCCL transport"]
    if t["status"] != "ran":
        return out + [f"skipped: {t['reason']}"]
    log = t["log"]
    out.append(
        f"NCCL {log['version'] or '?'}, {log['nranks']} ranks on {log['nnodes']} nodes, "
        f"network {', '.join(log['networks']) or '?'}, devices "
        f"{'; '.join(f'{k}: ' + ', '.join(v) for k, v in log['net_devices'].items()) or '-'}"
    )
    for p in log["peers"]:
        out.append(
            f"  rank {p['src']} ({p['src_host']}) -> rank {p['dst']} ({p['dst_host']}): "
            f"{', '.join(p['transports'])} on {p['channels']} channel(s)"
        )
    for channel, ranks in sorted(log["rings"].items(), key=lambda kv: int(kv[0])):
        out.append(f"  ring channel {int(channel):02d}: {' -> '.join(map(str, ranks))}")
    out += [f"  [{v['severity']}] {v['message']}" for v in t["verdict"]]
    out += [f"  [warning] NCCL WARN {w}" for w in log["warnings"]]
    return out


def bandwidth_lines(report: Dict) -> List[str]:
    b = report["bandwidth"]
    if b["status"] != "ran":
        return ["== Collective bandwidth", f"{b['status']}: {b.get('reason')}"]
    out = [
        f"== Collective bandwidth ({b['backend']}, {b['world_size']} ranks on {b['node_count']} "
        f"node(s); busbw as nccl-tests defines it)",
        f"{'op':<15}{'size':>11}{'count':>12}{'time(us)':>12}{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}  check",
    ]
    for r in b["rows"]:
        out.append(
            f"{r['op']:<15}{human_bytes(r['size_bytes']):>11}{r['count']:>12}{r['time_us']:>12.1f}"
            f"{r['algbw_gbps']:>13.3f}{r['busbw_gbps']:>13.3f}  {'ok' if r['correct'] else 'WRONG'}"
        )
    return out


def gpu_lines(report: Dict) -> List[str]:
    out = ["== GPU health"]
    for n in report["nodes"]:
        if "gpus" not in n:
            continue
        if not n["gpus"]:
            out.append(f"node {n['node_ip']}: no GPU: {n.get('gpu_error') or 'NVML sees none'}")
            continue
        for g, h in zip(n["gpus"], n["gpu_health"], strict=False):
            out.append(
                f"node {n['node_ip']} GPU {g['index']} {g['name']}: {h['status']}, "
                f"{g.get('temperature_c')} C, {g.get('power_w')} W of {g.get('power_limit_w')} W, "
                f"SM {g.get('sm_clock_mhz')}/{g.get('sm_clock_max_mhz')} MHz, "
                f"uncorrected ECC {g.get('ecc_volatile_uncorrected')}"
            )
            out += _tagged(h["problems"], "    ")
        if not n.get("xid_log", {}).get("readable"):
            out.append(f"  XID log not readable: {n.get('xid_log', {}).get('error')}")
    return out


def network_lines(report: Dict) -> List[str]:
    out = ["== Network"]
    for n in report["nodes"]:
        if "interfaces" not in n:
            continue
        ifaces = ", ".join(
            f"{i['name']} ({i['state']}"
            + (f", {i['speed_mbps']} Mb/s" if i["speed_mbps"] else "")
            + (f", {' '.join(i['addresses'])}" if i["addresses"] else "")
            + ")"
            for i in n["interfaces"]
        )
        out.append(f"node {n['node_ip']}: {ifaces}")
        ib = n["infiniband"]
        ports = [
            f"{d} port {p}: {v['state']} {v['rate'] or ''} {v['link_layer'] or ''}".rstrip()
            for d, info in ib.items()
            for p, v in info["ports"].items()
        ]
        out.append(
            f"  RDMA: {'; '.join(ports) if ports else 'no devices in /sys/class/infiniband'}"
        )
        problems = [f for f in n["findings"] if f["check"] in ("net_dev", "infiniband")]
        out += _tagged(problems) or ["  /proc/net/dev: no errors or unusual drops"]
    return out


def render_text(report: Dict) -> str:
    c, s = report["cluster"], report["summary"]
    lines = [
        f"raytrain-ext doctor: {c['nodes_alive']} node(s) alive, {c['gpus']} GPU(s), ray {c['ray']}"
    ]
    for section in (
        environment_lines,
        nccl_settings_lines,
        transport_lines,
        bandwidth_lines,
        gpu_lines,
        network_lines,
    ):
        lines += ["", *section(report)]
    probe_errors = [
        f for n in report["nodes"] for f in n["findings"] if f["check"] in ("probe", "gpu_count")
    ]
    lines += [
        "",
        f"== Summary: {s['errors']} error(s), {s['warnings']} warning(s)",
        *_tagged(probe_errors),
    ]
    if s["unhealthy_gpus"]:
        lines.append(f"  unhealthy GPUs: {', '.join(s['unhealthy_gpus'])}")
    if s["wrong_results"]:
        lines.append(f"  collectives returned wrong results: {', '.join(s['wrong_results'])}")
    return "\n".join(lines)
