"""The launcher's agent: what a node says while it waits at the rendezvous."""

import time

from loom.cluster import NodeSpec
from loom.launch.agent import RendezvousWatch
from loom.launch.cli import main
from tests.helpers import free_port


def test_a_node_whose_master_is_not_up_says_so(capfd):
    port = free_port()  # nothing listens there
    with RendezvousWatch(NodeSpec(nnodes=3, node_rank=1, master_addr="127.0.0.1", master_port=port), attempt=0, interval=0.5):
        time.sleep(1.8)
    lines = capfd.readouterr().err.splitlines()
    assert lines, "no line while waiting"
    assert lines[0].startswith("loom: node 1 has waited ")
    assert lines[0].endswith(f"s for node 0, whose rendezvous at 127.0.0.1:{port} is not reachable yet")


def test_a_bad_report_interval_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("LOOM_RENDEZVOUS_REPORT", "soon")
    assert main(["run", "--nproc", "1", "x.py"]) == 2
    assert capsys.readouterr().err == (
        "loom: error: LOOM_RENDEZVOUS_REPORT='soon' is not a finite positive number of seconds; unset it for the default (30)\n"
    )
