"""``loom run --groups``: its bad input in one line, the launcher's membership lines, the batch split.

The launched jobs (a kill -9 mid-step, equivalence with OneDevice) are in tests/strategies/test_fault_tolerant.py.
"""

import socket
import time

import pytest

import loom
from loom.comm.groups import EventLog, EventReader
from loom.errors import LaunchError
from loom.launch.cli import main
from loom.launch.groups import MembershipLines
from loom.strategies.data_parallel.fault_tolerant import FaultTolerantMirroredStrategy
from loom.strategies.data_parallel.fault_tolerant_data import group_slice
from tests.helpers import free_port


def test_bad_groups_input_is_one_line(capsys):
    assert main(["run", "--groups", "2", "--ps", "1", "x.py"]) == 2
    assert capsys.readouterr().err.startswith("loom: error: --groups replicates the model in every group; parameter servers")
    assert main(["run", "--lighthouse", "h:1", "x.py"]) == 2
    assert capsys.readouterr().err == "loom: error: --lighthouse is for replica groups: add --groups G (the job's number of groups)\n"
    assert main(["run", "--groups", "0", "x.py"]) == 2
    assert "--groups takes a number of replica groups, at least 1 (got 0)" in capsys.readouterr().err
    port = free_port()  # nothing listens there
    assert main(["run", "--groups", "2", "--lighthouse", f"127.0.0.1:{port}", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"loom: error: the lighthouse at 127.0.0.1:{port} cannot be reached within 5s (") and err.count("\n") == 1
    assert main(["run", "--groups", "2", "--lighthouse", "nowhere", "x.py"]) == 2
    assert "--lighthouse takes HOST:PORT" in capsys.readouterr().err


def test_bad_input_of_groups_across_machines_is_one_line(capsys, monkeypatch):
    assert main(["run", "--groups", "2", "--group", "1", "x.py"]) == 2
    assert capsys.readouterr().err == (
        "loom: error: --group I runs one group of a job across machines: add --lighthouse HOST:PORT (start it with `loom lighthouse`)\n"
    )
    assert main(["run", "--group", "1", "--lighthouse", "h:1", "x.py"]) == 2
    assert capsys.readouterr().err == "loom: error: --group is for replica groups: add --groups G (the job's number of groups)\n"
    assert main(["run", "--groups", "2", "--group", "2", "--lighthouse", "h:1", "x.py"]) == 2
    assert capsys.readouterr().err == "loom: error: --group takes this host's group, 0 .. 1 of --groups 2 (got 2)\n"
    port = free_port()
    started = time.monotonic()
    assert main(["run", "--groups", "2", "--group", "0", "--lighthouse", f"127.0.0.1:{port}", "x.py"]) == 2
    assert capsys.readouterr().err.startswith(f"loom: error: the lighthouse at 127.0.0.1:{port} cannot be reached within 5s (")
    assert time.monotonic() - started < 10
    assert main(["lighthouse", "--min-groups", "0"]) == 2
    assert capsys.readouterr().err == "loom: error: --min-groups takes the groups a step needs, at least 1 (got 0)\n"
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["lighthouse", "--port", str(port)]) == 2
        assert capsys.readouterr().err.startswith(f"loom: error: the lighthouse cannot listen on port {port} (")
        monkeypatch.setenv("LOOM_GROUP_ADDRESS", "no such host!")  # a lighthouse is reached (the listening socket)
        assert main(["run", "--groups", "2", "--group", "0", "--lighthouse", f"127.0.0.1:{port}", "x.py"]) == 2
    assert capsys.readouterr().err == (
        "loom: error: LOOM_GROUP_ADDRESS='no such host!' is neither an IP address nor a host name that resolves: set it to the "
        "address where the other groups' hosts reach this one, or unset it (this host's address towards the lighthouse is the default)\n"
    )


@pytest.mark.parametrize("make", [lambda: loom.ShardedStrategy(), lambda: loom.PipelineStrategy(stages=2), lambda: loom.OneDeviceStrategy()])
def test_a_strategy_that_does_not_train_across_groups_is_refused_under_groups(monkeypatch, make):
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://h:1")
    with pytest.raises(LaunchError, match=r"^under `loom run --groups` each group would train alone with \w+Strategy: use loom.auto_strategy\(\)"):
        make()


def test_the_strategy_outside_groups_says_how_to_start_them(monkeypatch):
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(LaunchError, match=r"start the script with `loom run --groups G --nproc N script.py`"):
        FaultTolerantMirroredStrategy()


@pytest.mark.parametrize("batch,size,count", [(12, 1, 2), (12, 2, 2), (12, 1, 5), (12, 3, 3), (8, 2, 3)])
def test_a_global_batch_splits_whole_among_the_groups_in_units_of_a_group(batch, size, count):
    slices = [group_slice(batch, size, r, count) for r in range(count)]
    assert slices[0][0] == 0 and slices[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    lengths = [stop - start for start, stop in slices]
    assert all(n % size == 0 for n in lengths) and max(lengths) - min(lengths) <= size


def test_a_batch_too_small_for_the_groups_is_refused():
    with pytest.raises(ValueError, match="a global batch of 4 cannot give 3 groups of 2 processes a sample each"):
        group_slice(4, 2, 0, 3)


def _commit(t, batch, groups, group=0):
    return {"event": "commit", "t": t, "group": group, "batch": batch, "groups": groups}


def test_the_launcher_says_when_a_group_leaves_rejoins_and_heals():
    lines = MembershipLines()
    said = []
    for event in [
        _commit(10.0, 3, [0, 1]),
        _commit(10.0, 3, [0, 1], group=1),
        {"event": "refused", "t": 10.5, "group": 0, "batch": 4},
        {"event": "refused", "t": 10.5, "group": 1, "batch": 4},
        _commit(12.5, 4, [0]),
        _commit(13.0, 5, [0]),
        _commit(20.5, 6, [0, 1]),
        {"event": "healed", "t": 20.6, "group": 1, "batch": 6, "seconds": 0.25},
        {"event": "healed", "t": 30.0, "group": 1, "batch": 9, "seconds": 0.5, "dropped": 2},
        {"event": "healed", "t": 40.0, "group": 1, "batch": 12, "seconds": 0.5, "dropped": None},
    ]:
        said += lines.feed(event)
    healed = "healed at batch {} in 0.5s (a live group's weights and optimizer state, no checkpoint); "
    assert said == [
        "batch 4 not applied: a group failed during its step; the groups alive train it again",
        "group 1 left at batch 4: group(s) 0 went on without it 2.5s after the last step with it",
        "group 1 rejoined at batch 6, 8.0s after it left",
        "group 1 healed at batch 6 in 0.2s (a live group's weights and optimizer state, no checkpoint)",
        "group 1 " + healed.format(9) + "it dropped its own last 2 step(s): the lighthouse had split the quorum, and it trained "
        "them on a branch of its own, which the kept branch trained too",
        "group 1 " + healed.format(12) + "whether it dropped steps of its own cannot be told: its branch, or how far it was "
        "behind, goes past the steps whose digests are kept",
    ]
    assert lines.last_groups == {0: {0, 1}, 1: {0, 1}}


def test_events_are_read_once_and_a_line_being_written_waits(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_FT_EVENTS", str(tmp_path))
    log, reader = EventLog(3), EventReader(tmp_path)
    log.write("commit", batch=0, groups=[3])
    with open(tmp_path / "group-3.jsonl", "a") as f:
        f.write('{"event": "comm')  # half a line
    assert [e["batch"] for e in reader.read()] == [0]
    with open(tmp_path / "group-3.jsonl", "a") as f:
        f.write('it", "t": 1e10, "group": 3, "batch": 1, "groups": [3]}\n')
    assert [e["batch"] for e in reader.read()] == [1]
    assert reader.read() == []
    assert not list(tmp_path.glob("group-4*")) and EventLog(4, enabled=False).write("commit") is None
