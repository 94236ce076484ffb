"""``raytrain-ext doctor``: diagnose the Ray cluster a job would train on.

One probe task per alive node (pinned with NodeAffinitySchedulingStrategy)
reports versions, GPUs (NVML), NCCL settings and network; a gang of
benchmark actors times all_reduce / all_gather / reduce_scatter / broadcast
(NCCL on GPUs, gloo otherwise) and, on GPUs, captures NCCL's INFO log to show
which transport NCCL actually chose per peer.  The report is a plain dict
(``--json`` prints it) rendered as text by :mod:`raytrain_ext.ops.doctor.text`.

Exit status: 0 when nothing is at error severity, 1 when something is (an
unhealthy GPU, a broken NCCL setting, a node that did not answer, a failed
benchmark), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any, Callable, Dict, List, Tuple

from raytrain_ext.ops.doctor import network
from raytrain_ext.ops.doctor.collectives import OPS, parse_size, size_range
from raytrain_ext.ops.doctor.findings import finding
from raytrain_ext.ops.doctor.gpu_health import evaluate_gpu
from raytrain_ext.ops.doctor.nccl_env import check_nccl_env
from raytrain_ext.ops.doctor.nccl_log import parse_nccl_log, transport_verdict

COMPARED_VERSIONS = ("python", "torch", "ray", "cuda", "nccl")


def add_parser(commands) -> None:
    p = commands.add_parser(
        "doctor",
        help="diagnose the Ray cluster: versions, NCCL settings and "
        "transport, collective bandwidth, GPU and network health",
    )
    p.add_argument(
        "--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else a local Ray)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--output", default=None, help="also write the JSON report to this file")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="ranks in the bandwidth test (default: every GPU in the cluster, or 2 without GPUs)",
    )
    p.add_argument(
        "--ops", default=",".join(OPS), help=f"collectives to time (default {','.join(OPS)})"
    )
    p.add_argument("--min-size", default="1K", help="smallest message, e.g. 1K (default 1K)")
    p.add_argument(
        "--max-size", default=None, help="largest message (default 1G on GPUs, 64M on CPU)"
    )
    p.add_argument(
        "--step-factor", type=int, default=4, help="size multiplier between rows (default 4)"
    )
    p.add_argument(
        "--iters", type=int, default=None, help="timed calls per row (default 20 GPU, 5 CPU)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed calls per row (default 5 GPU, 1 CPU)"
    )
    p.add_argument(
        "--skip-bench", action="store_true", help="no bandwidth test (and no transport check)"
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds for probes and for the process group"
    )
    p.set_defaults(func=run_doctor_command)


def run_doctor_command(args: argparse.Namespace) -> int:
    from raytrain_ext.ops.doctor.text import render_text

    try:
        ops = _parse_ops(args.ops)
        _check_bench_args(args)
    except ValueError as e:
        print(f"doctor: {e}", file=sys.stderr)
        return 2
    report = diagnose(args, ops)
    text = json.dumps(report, indent=2, default=str)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text if args.json else render_text(report))
    return 1 if report["summary"]["errors"] else 0


def _parse_ops(spec: str) -> List[str]:
    ops = [o.strip() for o in spec.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise ValueError(f"--ops {spec!r}: unknown {unknown}; choose from {','.join(OPS)}")
    return ops


def _check_bench_args(args: argparse.Namespace) -> None:
    """Fail on bad sizes or counts before connecting to a cluster."""
    size_range(parse_size(args.min_size), parse_size(args.max_size or "1G"), args.step_factor)
    for name in ("workers", "iters"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")


def diagnose(args: argparse.Namespace, ops: List[str]) -> Dict:
    """Probe every node, run the benchmark, and judge; returns the JSON-ready report."""
    import ray

    from raytrain_ext.ray_session import connect_ray, stop_private_ray

    started = connect_ray(args.address)
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        probes = probe_all(alive, args.timeout)
        nodes = [judge_node(p, len(alive)) for p in probes]
        total_gpus = int(sum(n["Resources"].get("GPU", 0) for n in alive))
        bench = _bandwidth(args, ops, total_gpus)
    finally:
        if started:
            stop_private_ray()
    report = {
        "cluster": {"nodes_alive": len(alive), "gpus": total_gpus, "ray": ray.__version__},
        "nodes": nodes,
        "mismatches": find_mismatches(nodes),
        "bandwidth": {k: v for k, v in bench.items() if k != "nccl_logs"},
        "transport": transport_section(bench, total_gpus),
    }
    report["summary"] = summarize(report)
    return report


def probe_all(alive: List[Dict], timeout_s: float) -> List[Dict]:
    """One pinned probe per node; a node that does not answer in time is reported as such."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_ext.ops.doctor.probe import probe_node

    task = ray.remote(num_cpus=0)(probe_node)
    refs = {
        n["NodeID"]: task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote()
        for n in alive
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out = []
    for n in alive:
        ref = refs[n["NodeID"]]
        base = {
            "node_id": n["NodeID"],
            "node_ip": n["NodeManagerAddress"],
            "ray_resources": {k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU")},
        }
        try:
            probe = ray.get(ref) if ref in ready else None
            out.append(
                {**base, **probe} if probe else {**base, "error": f"no answer in {timeout_s:.0f} s"}
            )
        except Exception as e:  # the probe itself failed on that node: report, keep going
            out.append({**base, "error": f"probe failed: {type(e).__name__}: {e}"})
    return out


def judge_node(p: Dict, n_nodes: int) -> Dict:
    """Attach findings and per-GPU health to one node's probe."""
    if "error" in p:
        return {
            **p,
            "findings": [finding("error", "probe", f"node {p['node_ip']}: {p['error']}")],
            "gpu_health": [],
        }
    gpus = p["gpus"]
    values = {k: v["value"] for k, v in p["nccl"].items()}
    found = check_nccl_env(
        values,
        interfaces=[i["name"] for i in p["interfaces"]],
        ib_ports=network.ib_port_states(p["infiniband"]),
        nvlink_active=sum(g.get("nvlink_active") or 0 for g in gpus),
        gpu_count=len(gpus),
        n_nodes=n_nodes,
    )
    found += network.net_dev_problems(p["net_dev"]) + network.infiniband_problems(p["infiniband"])
    ray_gpus = int(p["ray_resources"].get("GPU", 0))
    if ray_gpus != len(gpus):
        found.append(
            finding(
                "warning",
                "gpu_count",
                f"Ray advertises {ray_gpus} GPUs on this node but NVML sees {len(gpus)}",
            )
        )
    health = [{"index": g["index"], "name": g["name"], **evaluate_gpu(g)} for g in gpus]
    return {**p, "findings": found, "gpu_health": health}


def _version(package: str, node: Dict) -> Any:
    return node["versions"].get(package)


def find_mismatches(nodes: List[Dict]) -> List[Dict]:
    """Versions, driver and GPU models that differ between nodes (a job mixes them at its peril)."""
    probed = [n for n in nodes if "versions" in n]
    out = []
    keys: List[Tuple[str, Callable[[Dict], Any]]] = [
        (k, functools.partial(_version, k)) for k in COMPARED_VERSIONS
    ]
    keys += [
        ("driver", lambda n: n.get("driver")),
        ("gpu model", lambda n: ", ".join(sorted({g["name"] for g in n["gpus"]})) or None),
    ]
    for label, get in keys:
        seen: Dict[str, List[str]] = {}
        for n in probed:
            seen.setdefault(str(get(n)), []).append(n["node_ip"])
        if len(seen) > 1:
            shown = "; ".join(f"{v} on {', '.join(ips)}" for v, ips in sorted(seen.items()))
            out.append(
                finding(
                    "error" if label in ("torch", "nccl") else "warning",
                    "mismatch",
                    f"{label} differs between nodes: {shown}",
                )
            )
    return out


def _bandwidth(args, ops: List[str], total_gpus: int) -> Dict:
    if args.skip_bench:
        return {"status": "skipped", "reason": "--skip-bench"}
    from raytrain_ext.ops.doctor.bandwidth import run_benchmark

    gpu = total_gpus > 0
    workers = args.workers or (total_gpus if gpu else 2)
    sizes = size_range(
        parse_size(args.min_size),
        parse_size(args.max_size or ("1G" if gpu else "64M")),
        args.step_factor,
    )
    try:
        result = run_benchmark(
            workers,
            gpu,
            ops,
            sizes,
            args.iters or (20 if gpu else 5),
            args.warmup if args.warmup is not None else (5 if gpu else 1),
            args.timeout,
        )
    except Exception as e:  # report the failure (it is itself a diagnosis), do not crash the doctor
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}", "world_size": workers}
    return {"status": "ran", **result}


def transport_section(bench: Dict, total_gpus: int) -> Dict:
    if total_gpus == 0:
        ran = " (the bandwidth test ran on gloo)" if bench.get("status") == "ran" else ""
        return {
            "status": "skipped",
            "reason": f"no GPU in the cluster: NCCL is not used{ran}, so "
            "there is no NCCL transport to check",
        }
    if bench.get("status") != "ran":
        return {
            "status": "skipped",
            "reason": f"the bandwidth test did not run ({bench.get('reason')})",
        }
    log = parse_nccl_log("\n".join(bench.get("nccl_logs", [])))
    return {
        "status": "ran",
        "log": log.to_dict(),
        "verdict": [{"severity": s, "message": m} for s, m in transport_verdict(log)],
    }


def summarize(report: Dict) -> Dict:
    findings = [f for n in report["nodes"] for f in n["findings"]] + report["mismatches"]
    findings += [p for n in report["nodes"] for g in n["gpu_health"] for p in g["problems"]]
    verdict = report["transport"].get("verdict", [])
    errors = sum(f["severity"] == "error" for f in findings) + (
        report["bandwidth"]["status"] == "failed"
    )
    bad_rows = [r for r in report["bandwidth"].get("rows", []) if not r["correct"]]
    errors += len(bad_rows)
    warnings = sum(f["severity"] == "warning" for f in findings + verdict)
    return {
        "errors": errors,
        "warnings": warnings,
        "unhealthy_gpus": [
            f"{n['node_ip']} GPU {g['index']} ({g['name']})"
            for n in report["nodes"]
            for g in n["gpu_health"]
            if g["status"] == "unhealthy"
        ],
        "wrong_results": [f"{r['op']} {r['size_bytes']} B" for r in bad_rows],
    }
