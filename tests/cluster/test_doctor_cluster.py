"""raytrain-ext doctor on a real multi-node Ray cluster: every node probed, the benchmark spread."""

import json

import pytest


@pytest.mark.slow
def test_doctor_probes_every_node_and_spreads_the_benchmark(ray_cluster, capsys):
    from raytrain_ext.cli import main

    for _ in range(2):
        ray_cluster.add_node(num_cpus=1, object_store_memory=100 * 2**20)
    ray_cluster.wait_for_nodes()
    code = main(
        ["doctor", "--json", "--max-size", "4K", "--iters", "2", "--ops", "all_reduce,broadcast"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["summary"]
    assert report["cluster"]["nodes_alive"] == 3  # the CPU-less head is probed too
    assert len({n["node_id"] for n in report["nodes"]}) == 3
    assert all(n["versions"]["ray"] == report["cluster"]["ray"] for n in report["nodes"])
    assert report["mismatches"] == []
    bench = report["bandwidth"]
    assert (bench["world_size"], bench["node_count"]) == (2, 2)  # SPREAD: one rank per worker node
    assert len(bench["rows"]) == 4 and all(r["correct"] for r in bench["rows"])
