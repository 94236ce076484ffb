"""raytrain-ext doctor: NCCL log parsing, bandwidth formulas, NCCL env checks, GPU and
network evaluation: pure functions on fixtures, and bad arguments refused before Ray."""

from pathlib import Path

import pytest

from raytrain_ext.ops.doctor.collectives import (
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    elements,
    parse_size,
    size_range,
)
from raytrain_ext.ops.doctor.diagnosis import find_mismatches
from raytrain_ext.ops.doctor.gpu_health import decode_clock_events, evaluate_gpu, parse_xid_lines
from raytrain_ext.ops.doctor.nccl_env import check_nccl_env, match_interfaces, nccl_settings
from raytrain_ext.ops.doctor.nccl_log import classify_transport, parse_nccl_log, transport_verdict
from raytrain_ext.ops.doctor.network import (
    infiniband_problems,
    net_dev_problems,
    parse_proc_net_dev,
    read_infiniband,
)
from raytrain_ext.ops.doctor.probe import same_pci_device

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"


def nccl_fixture(name):
    return parse_nccl_log((FIXTURES / name).read_text())


def peers(log):
    return {(p["src"], p["dst"]): p for p in log.to_dict()["peers"]}


# --- NCCL log parser ---------------------------------------------------------------------


def test_ib_cluster_log_shows_ib_with_gdr_between_nodes_and_p2p_inside():
    log = nccl_fixture("ib_cluster.log")
    assert log.version == "2.21.5+cuda12.4"
    assert log.networks == ["IB"]
    assert log.net_devices == {"IB": ["mlx5_0:1/IB", "mlx5_1:1/IB"]}
    assert (log.nranks, log.nnodes) == (4, 2)
    assert log.rank_hosts == {0: "gpu-a", 1: "gpu-a", 2: "gpu-b", 3: "gpu-b"}
    # 8 ring connections + 4 tree connections, each logged by both ends but counted once
    assert len(log.connections) == 12
    p = peers(log)
    assert p[(1, 2)]["transports"] == ["NET/IB/GDRDMA"] and p[(1, 2)]["channels"] == 2
    assert (p[(1, 2)]["src_host"], p[(1, 2)]["dst_host"]) == ("gpu-a", "gpu-b")
    assert p[(0, 1)]["transports"] == ["P2P/CUMEM/read"]
    assert p[(0, 2)]["channels"] == 1  # tree-only edge
    assert log.rings == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    assert log.connected_all_rings and log.connected_all_trees
    verdict = transport_verdict(log)
    assert (
        "ok",
        "inter-node traffic uses InfiniBand/RoCE with GPUDirect RDMA (NET/IB .../GDRDMA)",
    ) in verdict
    assert not any("fell back" in m for _, m in verdict)


def test_socket_fallback_log_says_nccl_fell_back_to_tcp():
    log = nccl_fixture("socket_fallback.log")
    assert log.version == "2.20.5+cuda12.2" and log.networks == ["Socket"]
    assert log.net_devices == {"Socket": ["eth0:10.0.0.1<0>", "eth0:10.0.0.2<0>"]}
    assert {k: v["transports"] for k, v in peers(log).items()} == {
        (0, 1): ["NET/Socket"],
        (1, 0): ["NET/Socket"],
    }
    severity, message = transport_verdict(log)[0]
    assert severity == "warning"
    assert message.startswith(
        "NCCL fell back to TCP sockets (NET/Socket) between nodes for 2 rank pairs (0->1, 1->0)"
    )
    assert "no usable IB/RoCE device" in message


def test_single_node_log_is_all_p2p_on_four_rings():
    log = nccl_fixture("single_node_p2p.log")
    assert (log.nranks, log.nnodes, log.ib_missing) == (4, 1, True)
    assert {t for p in peers(log).values() for t in p["transports"]} == {"P2P/CUMEM/read"}
    assert log.rings[1] == [0, 3, 2, 1]
    assert transport_verdict(log) == [
        ("ok", "intra-node traffic uses GPU peer-to-peer (P2P over NVLink or PCIe)")
    ]


def test_older_nccl_formats_shm_and_warn_lines():
    text = "\n".join(
        [
            "sh-01:98911:98923 [3] NCCL INFO Ring 00 : 3[b01000] -> 4[201000] [send] via NET/Socket/0",
            "UIBE-01:13313:13991 [3] NCCL INFO Channel 00 : 3[3] -> 4[4] via SHM/direct/direct",
            "UIBE-01:13313:13991 [3] NCCL INFO Ring 00 : 2 -> 3 -> 4",
            "node2:14159:14168 [0] misc/ibvwrap.cc:187 NCCL WARN Call to ibv_modify_qp failed",
            "some unrelated line from the training script",
        ]
    )
    log = parse_nccl_log(text)
    assert [(c.channel, c.src, c.dst, c.via) for c in log.connections] == [
        (0, 3, 4, "NET/Socket/0"),
        (0, 3, 4, "SHM/direct/direct"),
    ]
    assert log.lines == 4 and log.warnings == ["node2: Call to ibv_modify_qp failed"]
    ring = parse_nccl_log(
        "\n".join(
            f"h:1:2 [{me}] NCCL INFO Ring 03 : {prev} -> {me} -> {nxt}"
            for prev, me, nxt in [(3, 0, 2), (0, 2, 1), (2, 1, 3), (1, 3, 0)]
        )
    )
    assert ring.rings == {3: [0, 2, 1, 3]}
    severities = dict((m.split(" ")[0], s) for s, m in transport_verdict(log))
    assert severities["NCCL"] == "warning" and severities["some"] == "info"


def test_transport_classification_and_empty_log():
    assert classify_transport("NET/IBext_v8/0/GDRDMA").label == "NET/IB/GDRDMA"
    assert classify_transport("NET/IB/1").gdr is False
    assert classify_transport("P2P/direct pointer/read").label == "P2P/direct pointer/read"
    assert classify_transport("NET/AWS Libfabric/0").family == "NET/AWS Libfabric"
    assert "NCCL_DEBUG=INFO" in transport_verdict(parse_nccl_log(""))[0][1]


# --- bandwidth formulas (nccl-tests doc/PERFORMANCE.md) -----------------------------------


def test_bus_bandwidth_factors_match_nccl_tests():
    assert [bus_factor("all_reduce", n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    assert [bus_factor("all_gather", n) for n in (2, 4, 8)] == [0.5, 0.75, 0.875]
    assert bus_factor("reduce_scatter", 4) == 0.75 and bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="unknown collective 'alltoall'"):
        bus_factor("alltoall", 2)


def test_bandwidth_by_hand():
    # 1 GiB all_reduce in 10 ms on 8 ranks: algbw = 1073741824 B / 0.01 s = 107.3741824 GB/s
    assert algbw_gbps(2**30, 0.01) == pytest.approx(107.3741824)
    assert busbw_gbps("all_reduce", 2**30, 0.01, 8) == pytest.approx(107.3741824 * 14 / 8)
    # 64 MiB all_gather over 4 ranks in 2 ms: 33.554432 GB/s algbw, x 3/4
    assert busbw_gbps("all_gather", 64 * 2**20, 0.002, 4) == pytest.approx(25.165824)
    assert busbw_gbps("broadcast", 10**9, 1.0, 16) == pytest.approx(1.0)


def test_sizes_follow_nccl_tests_total_size_convention():
    assert elements("all_reduce", 4096, 8) == (1024, 4096)
    assert elements("all_gather", 4096, 8) == (128, 4096)  # each rank sends S/n
    assert elements("reduce_scatter", 1000, 3) == (83, 996)  # rounded down to whole floats per rank
    assert elements("broadcast", 2, 4) == (1, 4)  # at least one element
    assert (
        parse_size("1K") == 1024 and parse_size("64M") == 64 * 2**20 and parse_size("1g") == 2**30
    )
    assert size_range(1024, 64 * 2**20, 4) == [4**i * 1024 for i in range(9)]
    with pytest.raises(ValueError, match="not a byte count"):
        parse_size("lots")
    with pytest.raises(ValueError, match="--step-factor"):
        size_range(1, 8, 1)


# --- NCCL environment checks --------------------------------------------------------------


def test_socket_ifname_matching_follows_nccl_rules():
    ifaces = ["lo", "eth0", "eth1", "docker0", "ens1f0"]
    assert match_interfaces("eth", ifaces) == ["eth0", "eth1"]
    assert match_interfaces("=eth", ifaces) == []
    assert match_interfaces("=eth1,ens1f0:5000", ifaces) == ["eth1", "ens1f0"]
    assert match_interfaces("^docker,lo", ifaces) == ["eth0", "eth1", "ens1f0"]
    assert match_interfaces("^=eth0", ifaces) == ["lo", "eth1", "docker0", "ens1f0"]


def check(values, *, interfaces=("lo", "eth0"), ib_ports=None, nvlink=0, gpus=8, nodes=2):
    return check_nccl_env(
        values,
        interfaces=list(interfaces),
        ib_ports=ib_ports or {},
        nvlink_active=nvlink,
        gpu_count=gpus,
        n_nodes=nodes,
    )


def by_check(findings):
    return {f["check"]: f for f in findings}


def test_ib_disabled_on_a_node_with_active_ib_is_flagged():
    found = by_check(
        check({"NCCL_IB_DISABLE": "1"}, ib_ports={"mlx5_0": ["ACTIVE"], "mlx5_1": ["DOWN"]})
    )
    assert found["NCCL_IB_DISABLE"]["severity"] == "warning"
    assert "active IB/RoCE devices (mlx5_0)" in found["NCCL_IB_DISABLE"]["message"]
    assert check({"NCCL_IB_DISABLE": "0"}, ib_ports={"mlx5_0": ["ACTIVE"]}) == []
    down = by_check(check({"NCCL_IB_DISABLE": "1"}, ib_ports={"mlx5_0": ["DOWN"]}))
    assert "NCCL_IB_DISABLE" not in down and "no port is ACTIVE" in down["infiniband"]["message"]


def test_socket_ifname_that_matches_nothing_or_only_loopback_is_an_error():
    missing = by_check(check({"NCCL_SOCKET_IFNAME": "ib0"}))["NCCL_SOCKET_IFNAME"]
    assert missing["severity"] == "error" and "matches no interface" in missing["message"]
    assert "(interfaces: lo, eth0)" in missing["message"]
    excluded = by_check(check({"NCCL_SOCKET_IFNAME": "^eth,lo"}))["NCCL_SOCKET_IFNAME"]
    assert excluded["severity"] == "error"
    loop = by_check(check({"NCCL_SOCKET_IFNAME": "lo"}, nodes=2))["NCCL_SOCKET_IFNAME"]
    assert "only the loopback" in loop["message"]
    assert check({"NCCL_SOCKET_IFNAME": "lo"}, nodes=1, gpus=1) == []
    assert check({"NCCL_SOCKET_IFNAME": "eth"}, ib_ports={"mlx5_0": ["ACTIVE"]}) == []


def test_p2p_hca_gdr_and_debug_checks():
    nvl = by_check(check({"NCCL_P2P_DISABLE": "1"}, nvlink=72))["NCCL_P2P_DISABLE"]
    assert nvl["severity"] == "warning" and "72 active NVLinks" in nvl["message"]
    assert by_check(check({"NCCL_P2P_LEVEL": "NVLINK"}))["NCCL_P2P_LEVEL"]["severity"] == "error"
    assert check({"NCCL_P2P_LEVEL": "nvl"}, ib_ports={"mlx5_0": ["ACTIVE"]}) == []
    hca = by_check(check({"NCCL_IB_HCA": "mlx5_1"}, ib_ports={"mlx5_0": ["ACTIVE"]}))["NCCL_IB_HCA"]
    assert "selects none of this node's IB devices (mlx5_0)" in hca["message"]
    assert check({"NCCL_IB_HCA": "^mlx5_1"}, ib_ports={"mlx5_0": ["ACTIVE"]}) == []
    assert (
        by_check(check({"NCCL_NET_GDR_LEVEL": "7X"}))["NCCL_NET_GDR_LEVEL"]["severity"] == "error"
    )
    assert (
        check({"NCCL_NET_GDR_LEVEL": "PXN", "NCCL_P2P_LEVEL": "2"}, ib_ports={"m": ["ACTIVE"]})
        == []
    )
    assert (
        by_check(check({"NCCL_DEBUG": "info"}, ib_ports={"m": ["ACTIVE"]}))["NCCL_DEBUG"][
            "severity"
        ]
        == "info"
    )
    assert by_check(check({}))["infiniband"]["message"].startswith("no IB/RoCE devices")


def test_nccl_settings_precedence_environment_then_user_then_system_conf():
    settings = nccl_settings(
        {"NCCL_DEBUG": "WARN", "PATH": "/bin"},
        [
            ("/home/u/.nccl.conf", "NCCL_DEBUG=INFO\nNCCL_SOCKET_IFNAME=eth0  # data net\n"),
            ("/etc/nccl.conf", "NCCL_SOCKET_IFNAME=ens\nNCCL_IB_HCA=mlx5\n"),
        ],
    )
    assert settings == {
        "NCCL_DEBUG": {"value": "WARN", "source": "environment"},
        "NCCL_IB_HCA": {"value": "mlx5", "source": "/etc/nccl.conf"},
        "NCCL_SOCKET_IFNAME": {"value": "eth0", "source": "/home/u/.nccl.conf"},
    }


# --- GPU health ---------------------------------------------------------------------------

HEALTHY = {
    "index": 0,
    "name": "NVIDIA H100 80GB HBM3",
    "temperature_c": 41,
    "slowdown_temp_c": 90,
    "power_w": 120.5,
    "power_limit_w": 700.0,
    "sm_clock_mhz": 1980,
    "sm_clock_max_mhz": 1980,
    "clock_events": ["gpu_idle"],
    "ecc_volatile_uncorrected": 0,
    "ecc_aggregate_uncorrected": 0,
    "retired_pages_pending": 0,
    "remapped_rows_pending": 0,
    "remapped_rows_failure": 0,
    "remapped_rows_uncorrectable": 0,
    "xids": [],
}


def test_healthy_gpu_and_unsupported_readings_are_ok():
    assert evaluate_gpu(HEALTHY) == {"status": "ok", "problems": []}
    consumer = {k: None for k in HEALTHY} | {"index": 0, "name": "GeForce"}
    assert evaluate_gpu(consumer)["status"] == "ok"


def test_hot_and_throttled_gpus():
    hot = evaluate_gpu({**HEALTHY, "temperature_c": 91})
    assert hot["status"] == "unhealthy"
    assert (
        hot["problems"][0]["message"]
        == "91 C is at or above the slowdown temperature (90 C): check cooling"
    )
    warm = evaluate_gpu({**HEALTHY, "temperature_c": 86})
    assert (
        warm["status"] == "warning" and "within 4 C of slowdown" in warm["problems"][0]["message"]
    )
    assert (
        evaluate_gpu({**HEALTHY, "slowdown_temp_c": None, "temperature_c": 88})["status"]
        == "unhealthy"
    )
    throttled = evaluate_gpu(
        {**HEALTHY, "clock_events": decode_clock_events(0x41), "sm_clock_mhz": 1100}
    )
    assert (
        throttled["status"] == "unhealthy"
        and "hw_thermal (SM 1100 of 1980 MHz)" in throttled["problems"][0]["message"]
    )
    assert evaluate_gpu({**HEALTHY, "clock_events": ["sw_power_cap"]})["status"] == "ok"


def test_ecc_remap_and_xid_problems():
    ecc = evaluate_gpu({**HEALTHY, "ecc_volatile_uncorrected": 2, "ecc_aggregate_uncorrected": 5})
    assert ecc["status"] == "unhealthy" and ecc["problems"][0]["message"].startswith(
        "2 uncorrected ECC errors"
    )
    old = evaluate_gpu({**HEALTHY, "ecc_aggregate_uncorrected": 5})
    assert old["status"] == "warning" and "lifetime" in old["problems"][0]["message"]
    assert evaluate_gpu({**HEALTHY, "remapped_rows_failure": 1})["status"] == "unhealthy"
    assert evaluate_gpu({**HEALTHY, "remapped_rows_pending": 1})["status"] == "warning"
    xids = parse_xid_lines(
        "[ 12.3] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n"
        "NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception: ESR 0x50"
    )
    assert [x["xid"] for x in xids] == [79, 13] and xids[0]["pci"] == "PCI:0000:3b:00"
    bad = evaluate_gpu({**HEALTHY, "xids": xids})
    assert bad["status"] == "unhealthy"
    assert [p["severity"] for p in bad["problems"]] == ["error", "warning"]
    assert "GPU has fallen off the bus" in bad["problems"][0]["message"]
    assert same_pci_device("PCI:0000:3b:00", "00000000:3B:00.0")
    assert not same_pci_device("PCI:0000:3b:00", "00000000:5E:00.0")


# --- network ------------------------------------------------------------------------------


def test_proc_net_dev_parsing_and_problems():
    counters = parse_proc_net_dev((FIXTURES / "proc_net_dev.txt").read_text())
    assert sorted(counters) == ["ens1f0", "eth0", "lo"]
    ens = counters["ens1f0"]
    assert (
        ens["rx_bytes"],
        ens["rx_packets"],
        ens["rx_errs"],
        ens["rx_drop"],
        ens["rx_frame"],
    ) == (98765432100, 81234567, 17, 4512, 3)
    assert (ens["rx_multicast"], ens["tx_bytes"], ens["tx_drop"], ens["tx_carrier"]) == (
        12345,
        87654321000,
        27,
        2,
    )
    problems = net_dev_problems(counters)
    assert [p["message"] for p in problems] == [
        "ens1f0: error counters since boot: rx_errs=17, rx_frame=3, tx_carrier=2"
    ]  # drops are 0.006%: noise
    lossy = net_dev_problems({"eth1": {"rx_packets": 1000, "rx_drop": 50}})
    assert lossy[0]["message"] == "eth1: rx dropped 50 of 1000 packets (5.00%)"


def test_infiniband_sysfs_reading(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    for name, value in {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "200 Gb/sec (4X HDR)",
        "link_layer": "InfiniBand",
    }.items():
        (port / name).write_text(value + "\n")
    (port / "counters" / "symbol_error").write_text("3\n")
    (port / "counters" / "port_rcv_errors").write_text("0\n")
    ib = read_infiniband(str(tmp_path))
    assert ib["mlx5_0"]["ports"]["1"] == {
        "state": "ACTIVE",
        "phys_state": "LinkUp",
        "rate": "200 Gb/sec (4X HDR)",
        "link_layer": "InfiniBand",
        "counters": {"symbol_error": 3, "port_rcv_errors": 0},
    }
    assert [p["message"] for p in infiniband_problems(ib)] == [
        "mlx5_0 port 1 error counters: symbol_error=3"
    ]
    assert read_infiniband(str(tmp_path / "absent")) == {}


def test_version_mismatches_name_the_nodes():
    def node(ip, torch, gpu):
        return {
            "node_ip": ip,
            "versions": {
                "python": "3.11.7",
                "torch": torch,
                "ray": "2.60.0",
                "cuda": "12.4",
                "nccl": "2.21.5",
            },
            "driver": "550.54.15",
            "gpus": [{"name": gpu}],
        }

    found = find_mismatches(
        [
            node("10.0.0.1", "2.6.0", "H100"),
            node("10.0.0.2", "2.5.1", "H100"),
            node("10.0.0.3", "2.6.0", "A100"),
        ]
    )
    assert [(f["severity"], f["message"]) for f in found] == [
        ("error", "torch differs between nodes: 2.5.1 on 10.0.0.2; 2.6.0 on 10.0.0.1, 10.0.0.3"),
        (
            "warning",
            "gpu model differs between nodes: A100 on 10.0.0.3; H100 on 10.0.0.1, 10.0.0.2",
        ),
    ]


def test_gpu_transport_section_from_captured_logs_renders_the_fallback():
    from raytrain_ext.ops.doctor.diagnosis import transport_section
    from raytrain_ext.ops.doctor.text import transport_lines

    logs = (FIXTURES / "socket_fallback.log").read_text().split("node2:4410:4410", 1)
    bench = {"status": "ran", "nccl_logs": [logs[0], "node2:4410:4410" + logs[1]]}
    section = transport_section(bench, total_gpus=2)
    lines = transport_lines({"transport": section})
    assert lines[1] == (
        "NCCL 2.20.5+cuda12.2, 2 ranks on 2 nodes, network Socket, devices "
        "Socket: eth0:10.0.0.1<0>, eth0:10.0.0.2<0>"
    )
    assert "  rank 0 (node1) -> rank 1 (node2): NET/Socket on 2 channel(s)" in lines
    assert "  ring channel 01: 0 -> 1" in lines
    assert any(line.startswith("  [warning] NCCL fell back to TCP sockets") for line in lines)
    assert transport_section({"status": "failed", "reason": "TimeoutError: x"}, 2)["reason"] == (
        "the bandwidth test did not run (TimeoutError: x)"
    )


def test_bad_arguments_exit_2_before_touching_ray(capsys):
    from raytrain_ext.cli import main

    assert main(["doctor", "--ops", "all_reduce,alltoall"]) == 2
    assert "--ops 'all_reduce,alltoall': unknown ['alltoall']" in capsys.readouterr().err
    assert main(["doctor", "--min-size", "1M", "--max-size", "1K"]) == 2
    assert "need 1 <= --min-size <= --max-size" in capsys.readouterr().err


# --- end to end ---------------------------------------------------------------------------
