"""raytrain-ext doctor end to end on a real local Ray: probes, the bandwidth gang (a WorkerGroup
of BenchWorkers) on gloo, the text report, and nothing left running."""

import json
import time

import pytest

from raytrain_ext.ops.doctor.collectives import (
    bus_factor,
)


@pytest.mark.slow
def test_doctor_end_to_end_on_cpu(ray_local, capsys):
    from ray._private.state import actors

    from raytrain_ext.cli import main
    from raytrain_ext.ops.doctor.text import render_text
    from tests.helpers.leaks import live_placement_groups

    start = time.time()
    code = main(["doctor", "--json", "--max-size", "256K", "--iters", "3"])
    elapsed = time.time() - start
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["summary"]
    (node,) = report["nodes"]
    assert node["node_ip"] == "127.0.0.1" and node["versions"]["torch"].startswith("2.")
    assert node["gpus"] == [] and node["gpu_error"].startswith("no NVIDIA driver on node 127.0.0.1")
    bench = report["bandwidth"]
    assert (bench["status"], bench["backend"], bench["world_size"]) == ("ran", "gloo", 2)
    rows = {(r["op"], r["size_bytes"]): r for r in bench["rows"]}
    assert sorted({op for op, _ in rows}) == [
        "all_gather",
        "all_reduce",
        "broadcast",
        "reduce_scatter",
    ]
    assert sorted({size for _, size in rows}) == [1024, 4096, 16384, 65536, 262144]
    for r in rows.values():
        assert r["ranks"] == 2 and r["busbw_gbps"] > 0 and r["correct"]
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], 2))
    assert report["transport"]["status"] == "skipped" and "no GPU" in report["transport"]["reason"]
    text = render_text(report)
    assert "== Collective bandwidth (gloo, 2 ranks on 1 node(s)" in text
    assert "node 127.0.0.1: no GPU: no NVIDIA driver on node 127.0.0.1" in text
    assert "NCCL transport\nskipped: no GPU in the cluster" in text
    assert elapsed < 40, f"doctor took {elapsed:.1f} s"
    bench_actors = [
        a
        for a in actors().values()
        if a["ActorClassName"].endswith("BenchWorker") and a["State"] != "DEAD"
    ]
    assert bench_actors == [] and live_placement_groups() == []
