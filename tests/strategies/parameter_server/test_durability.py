"""A parameter server keeps every update it acknowledged: a write-ahead log over its last snapshot.

The server here is called directly and "killed" by dropping it without a save; what a restart
finds is exactly the files on disk. The launched kill -9 test is in tests/launch/test_parameter_server_durability.py.
"""

import pickle

import pytest
import torch

from loom.errors import CheckpointError
from loom.strategies.parameter_server import serve, wal
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.state_file import LostUpdatesError

OPTIMIZER = {"kind": "Adagrad", "groups": [{"lr": 0.1}], "assign": {}, "lazy_rows": False}


def fresh(path, optimizer=OPTIMIZER):
    server, line = ParameterServer.recover("secret", path)
    assert line == ""  # nothing kept yet
    server.handle({"op": "create", "optimizer": optimizer, "generate": {}}, {"dense/w": torch.ones(2, 3), "table/emb": torch.zeros(5, 4)})
    return server


def push(server, worker, seq, value, **extra):
    fields = {"op": "push", "worker": worker, "seq": seq, **extra}
    rows = {"rowids/emb": torch.tensor([seq % 5]), "rowgrad/emb": torch.full((1, 4), value)}
    server.handle(fields, {"grad/w": torch.full((2, 3), value), **rows})
    return server.handle({"op": "commit", "worker": worker, "seq": seq}, {})[0]


def state(server):
    slots = {var: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for var, s in server.optimizer.state.items()}
    return server.dense, server.tables, slots, server.applied, server.version, server.round


def assert_same(a, b):
    for x, y in zip(state(a), state(b)):
        if isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), dict):
            assert x.keys() == y.keys()
            for var in x:
                assert x[var].keys() == y[var].keys() and all(
                    torch.equal(x[var][k], y[var][k]) if isinstance(x[var][k], torch.Tensor) else x[var][k] == y[var][k] for k in x[var]
                )
        else:
            assert x == y


def test_a_server_killed_after_acknowledging_comes_back_with_every_update(tmp_path):
    path = tmp_path / "server-0.safetensors"
    server = fresh(path)
    for seq in range(3):
        push(server, "worker-0.1", seq, 0.5 + seq)
    server.save(path)  # a snapshot, then more updates only the log holds
    for seq in range(3, 7):
        push(server, "worker-0.1", seq, 0.5 + seq)
    push(server, "worker-1.2", 0, -1.0)
    back, line = ParameterServer.recover("secret", path)  # the first one is never saved again: as after kill -9
    assert line == "8 updates: 3 from its snapshot, 5 from its log"
    assert_same(back, server)
    assert back.handle({"op": "commit", "worker": "worker-0.1", "seq": 6}, {})[0] == {"applied": False, "missing": False}  # a retry: applied once
    assert wal.generations(path) == [back.log.generation]  # its own snapshot holds what it replayed


@pytest.mark.parametrize("kind, hyper", [("RMSprop", {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "centered": True}),
                                         ("Adadelta", {"lr": 1.0, "rho": 0.8})])  # fmt: skip
def test_rmsprop_and_adadelta_slots_come_back_from_the_snapshot_and_the_log_and_step_on(tmp_path, kind, hyper):
    path = tmp_path / "server-0.safetensors"
    server = fresh(path, {"kind": kind, "groups": [hyper], "assign": {}, "lazy_rows": False})
    push(server, "worker-0.1", 0, 0.5)
    server.save(path)
    push(server, "worker-0.1", 1, -1.5)
    back, _ = ParameterServer.recover("secret", path)
    assert_same(back, server)
    slots = {"RMSprop": {"step", "square_avg", "momentum_buffer", "grad_avg"}, "Adadelta": {"step", "square_avg", "acc_delta"}}[kind]
    assert set(back.optimizer.state["w"]) == slots
    for target in (server, back):  # the next step uses the slots that came back
        push(target, "worker-0.1", 2, 2.0)
    assert_same(back, server)


def test_a_killed_server_that_never_saved_comes_back_from_its_log_alone(tmp_path):
    path = tmp_path / "server-0.safetensors"
    server = fresh(path)
    push(server, "worker-0.1", 0, 2.0)
    assert not path.exists()
    back, line = ParameterServer.recover("secret", path)
    assert line == "1 updates: 0 from its snapshot, 1 from its log"
    assert back.created and back.optimizer.kind == "Adagrad"
    assert_same(back, server)


def test_a_round_share_acknowledged_before_the_kill_is_still_given(tmp_path):
    path = tmp_path / "server-0.safetensors"
    server = fresh(path)
    for worker in (0, 1):
        push(server, f"worker-{worker}.1", 0, 1.0 + worker, index=worker, sync=2)
    push(server, "worker-0.1", 1, 5.0, index=0, sync=2)  # round 1 waits for worker 1
    back, _ = ParameterServer.recover("secret", path)
    assert back.round == 0 and back.wait_for_round(1, timeout=0) == {"round": 0, "given": ["0"]}
    for target in (server, back):
        push(target, "worker-1.1", 1, 7.0, index=1, sync=2)
    assert back.round == 1
    assert_same(back, server)


def test_a_record_cut_short_by_the_kill_was_never_acknowledged_and_is_skipped(tmp_path):
    path = tmp_path / "server-0.safetensors"
    server = fresh(path)
    push(server, "worker-0.1", 0, 2.0)
    with open(wal.generation_path(path, server.log.generation), "ab") as log:
        log.write(b"\x40\x00\x00")  # the first bytes of a record's header
    back, line = ParameterServer.recover("secret", path)
    assert line == "1 updates: 0 from its snapshot, 1 from its log"
    assert_same(back, server)


def test_a_damaged_log_is_replayed_up_to_the_damage_and_said(tmp_path):
    path = tmp_path / "server-0.safetensors"
    server = fresh(path)
    push(server, "worker-0.1", 0, 2.0)
    push(server, "worker-0.1", 1, 3.0)
    log = wal.generation_path(path, server.log.generation)
    data = bytearray(log.read_bytes())
    data[-5] ^= 0xFF  # inside the last record's tensor bytes: it is whole, but not what was written
    log.write_bytes(bytes(data))
    back, line = ParameterServer.recover("secret", path)
    assert line.startswith("1 updates: 0 from its snapshot, 1 from its log; the log ends early: record 2 of ")
    assert line.endswith(" is damaged (its digest does not match)")


def test_a_worker_that_saw_more_than_the_server_came_back_with_stops_it(tmp_path):
    """The state files were removed: the restarted server has nothing, a worker had seen update 7."""
    back, _ = ParameterServer.recover("secret", tmp_path / "server-0.safetensors")
    assert back.handle({"op": "ready", "seen": -1}, {})[0] == {"ready": False}  # a worker that saw nothing yet
    message = "lost 7 updates that workers saw applied: it came back at update 0, a worker had seen update 7"
    with pytest.raises(LostUpdatesError, match=message):
        back.handle({"op": "pull_rows", "table": "emb", "seen": 7}, {"ids": torch.tensor([0])})
    with pytest.raises(LostUpdatesError, match="lost 9 updates"):  # from then on it refuses everything, the count the largest seen
        back.handle({"op": "ready", "seen": 9}, {})
    assert back.lost == {"seen": 9, "resumed_at": 0}


class Payload:
    """Pickled, it creates ``path`` when unpickled: loading it ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("kind", ["snapshot", "log"])
@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_crafted_pickle_as_a_state_file_is_refused_in_one_line_and_never_runs(tmp_path, kind, writer, monkeypatch, capsys):
    path, ran = tmp_path / "server-1.safetensors", tmp_path / "payload-ran"
    target = path if kind == "snapshot" else wal.generation_path(path, 0)
    if writer == "pickle":
        target.write_bytes(pickle.dumps(Payload(ran)))
    else:
        torch.save({"w": torch.ones(1), "x": Payload(ran)}, target)
    with pytest.raises(CheckpointError, match=rf"^{target} is not a (parameter-server state file loom wrote|loom parameter-server log)"):
        ParameterServer.recover("secret", path)
    monkeypatch.setenv("LOOM_PS_TOKEN", "secret")
    assert serve.main(["--port", "0", "--index", "1", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"loom: error: parameter server 1: {target} is not a ") and err.count("\n") == 1
    assert not ran.exists()
