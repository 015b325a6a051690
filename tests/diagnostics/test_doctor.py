"""`loom doctor` passes a healthy two-node job and names each problem with its fix."""

import subprocess

import pytest

from loom.cluster import NodeSpec
from loom.diagnostics.doctor import _compare, reach_master
from tests.helpers import LOOM, ROOT, free_port, job_env, popen, wait_all
from tests.netns import network, on_host, sh, why_no_namespaces

pytestmark = pytest.mark.xdist_group("doctor")


def doctors(tmp_path, node1_env=None):
    master = f"127.0.0.1:{free_port()}"
    return wait_all([
        popen(
            [*LOOM, "doctor", "--nnodes", "2", "--node-rank", str(rank), "--master", master, "--nproc", "1",
             "--threads", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--wait", "30"],
            cwd=ROOT, env=job_env(node1_env if rank else None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ], timeout=90)  # fmt: skip


def test_a_healthy_two_node_job_passes(tmp_path):
    (code0, out0, err0), (code1, out1, _) = doctors(tmp_path)
    assert (code0, code1) == (0, 0), out0 + err0
    assert "ok    node 1 (" in out0 and "reaches the master 127.0.0.1:" in out0
    assert "sets GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo" in out0
    assert "ok    an all-reduce across the 2 nodes gave the right sum" in out0
    assert "ok    bandwidth node 0 (" in out0 and " MB/s" in out0
    assert "checkpoint directory" in out0 and "FAIL" not in out0
    assert out0.strip().endswith("loom doctor: the job would start")
    assert "node 0 found the job would start" in out1


def report(node, torch_version="2.13.0"):
    return {"node": node, "host": f"h{node}", "versions": {"torch": torch_version, "loom": "0.1.0", "python": "3.11.7"},
            "checkpoint": None, "findings": []}  # fmt: skip


def test_a_version_mismatch_is_named_with_its_fix():
    checks = {0: {"all_reduce": None, "bandwidth": {}}, 1: {"all_reduce": None, "bandwidth": {"0-1": 12.5}}}
    lines = [f.line() for f in _compare({0: report(0), 1: report(1, "2.12.1")}, checks, 2)]
    assert "FAIL  node 1 (h1) has torch 2.12.1 but node 0 has 2.13.0; fix: install torch 2.13.0 on node 1 (h1) (every node must run the same versions)" in lines
    assert "ok    bandwidth node 0 (h0) -> node 1 (h1): 12 MB/s" in lines


def test_a_node_that_does_not_see_node_0s_checkpoint_directory_is_named():
    reports = {0: {**report(0), "checkpoint": "/ckpt"}, 1: {**report(1), "checkpoint": "/ckpt", "sees_node0_checkpoint": False}}
    lines = [f.line() for f in _compare(reports, {0: {"all_reduce": None, "bandwidth": {}}, 1: {"all_reduce": None, "bandwidth": {}}}, 2)]
    assert "FAIL  node 1 (h1) does not see node 0's checkpoint directory /ckpt; fix: put checkpoints on storage every node mounts at the same path (NFS, a parallel filesystem)" in lines


def test_a_closed_port_is_named_with_its_fix():
    port = free_port()  # nothing listens there
    found = reach_master(NodeSpec(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port), wait=0.5)
    assert f"nothing listens on the master's port 127.0.0.1:{port} (connection refused); fix: start node 0 first" in found.line()


def test_a_master_name_that_does_not_resolve_is_named_with_its_fix():
    found = reach_master(NodeSpec(nnodes=2, node_rank=1, master_addr="node0.invalid", master_port=29500), wait=0.5)
    assert "the master's host node0.invalid does not resolve; fix: pass --master with an address or a name every node resolves" in found.line()



NO_NETNS = why_no_namespaces()
needs_netns = pytest.mark.skipif(NO_NETNS is not None, reason=NO_NETNS or "")
HOSTS = {"a": "10.79.7.1", "b": "10.79.7.2"}


def doctors_on_hosts(port, wait="5"):
    command = [*LOOM, "doctor", "--nnodes", "2", "--master", f"{HOSTS['a']}:{port}", "--nproc", "1", "--threads", "1", "--wait", wait]
    return [
        subprocess.Popen(on_host(host, [*command, "--node-rank", str(rank)], prefix="d"), cwd=ROOT, env=job_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for rank, host in enumerate(HOSTS)
    ]  # fmt: skip


@needs_netns
def test_a_host_whose_link_is_cut_is_named():
    with network(HOSTS, prefix="d") as links:
        sh("ip", "link", "set", links["b"], "down")
        command = [*LOOM, "doctor", "--nnodes", "2", "--node-rank", "1", "--master", f"{HOSTS['a']}:{free_port()}", "--nproc", "1", "--wait", "1"]
        job = subprocess.run(on_host("b", command, prefix="d"), cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=60)
    assert job.returncode == 1
    assert f"FAIL  node 1 (host-b): cannot reach the master {HOSTS['a']} (" in job.stdout, job.stdout
    assert "fix: check that 10.79.7.1 is node 0's address on a network this node is on" in job.stdout


@needs_netns
def test_a_link_shaped_to_100_mbit_is_measured_within_20_percent():
    with network(HOSTS, prefix="d") as links:
        sh("tc", "qdisc", "add", "dev", links["b"], "root", "tbf", "rate", "100mbit", "burst", "32kb", "latency", "400ms")
        (code_a, out_a, err_a), _ = wait_all(doctors_on_hosts(free_port(), wait="30"), timeout=90)
    assert code_a == 0, out_a + err_a
    rate = float(out_a.split("bandwidth node 0 (host-a) -> node 1 (host-b): ")[1].split(" MB/s")[0].replace(",", ""))
    assert 0.8 * 12.5 <= rate <= 1.2 * 12.5, rate
