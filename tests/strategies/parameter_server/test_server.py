"""A parameter server over gRPC: pulls, pushes applied once and whole, tokens, lost servers."""

import threading
import time

import pytest
import torch

from loom.errors import LoomError
from loom.strategies.parameter_server.client import ServerClient, ServerUnavailableError
from loom.strategies.parameter_server.optimizers import ServerOptimizer
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.settle import settle
from tests.helpers import free_port


def push(target, fields, tensors):
    """Stage a push and commit it, as a worker does; whether the commit applied it.

    ``target``: a client, or a server called directly."""
    call = target.call if isinstance(target, ServerClient) else lambda f, t=None: (target.handle(f, t or {})[0], {})
    call({"op": "push", **fields}, tensors)
    return call({"op": "commit", "worker": fields["worker"], "seq": fields["seq"]})[0]["applied"]


@pytest.fixture
def served():
    server = ParameterServer("secret", {"w": torch.ones(2, 3)}, {"emb": torch.zeros(5, 4)}, ServerOptimizer("SGD", [{"lr": 0.5}]))
    port = server.serve(free_port())
    client = ServerClient(f"127.0.0.1:{port}", "secret", patience=2)
    yield server, client, port
    client.close()
    server.stop()


def test_pull_push_and_rows(served):
    server, client, _ = served
    _, pulled = client.call({"op": "pull", "names": ["w"]})
    assert torch.equal(pulled["w"], torch.ones(2, 3))
    grads = {"grad/w": torch.full((2, 3), 2.0), "rowids/emb": torch.tensor([1, 3, 1]), "rowgrad/emb": torch.ones(3, 4)}
    assert push(client, {"worker": "w0", "seq": 0}, grads)
    assert torch.equal(server.dense["w"], torch.zeros(2, 3))  # 1 - 0.5 * 2
    _, rows = client.call({"op": "pull_rows", "table": "emb"}, {"ids": torch.tensor([1, 3, 0])})
    assert rows["rows"][:, 0].tolist() == [-1.0, -0.5, 0.0]  # row 1 pushed twice: gradients summed


def test_a_retried_push_is_applied_once(served):
    server, client, _ = served
    grads = {"grad/w": torch.ones(2, 3)}
    for _ in range(3):  # the same sequence number: a retry after a lost reply
        push(client, {"worker": "w0", "seq": 5}, grads)
    push(client, {"worker": "w1", "seq": 0}, grads)
    assert client.call({"op": "stats"})[0]["applied"] == {"w0": 1, "w1": 1}
    assert torch.equal(server.dense["w"], torch.zeros(2, 3))  # 1 - 2 * 0.5


def test_a_bad_push_changes_nothing(served):
    server, client, _ = served
    bad = {"grad/w": torch.ones(2, 3), "rowids/emb": torch.tensor([9]), "rowgrad/emb": torch.ones(1, 4)}
    with pytest.raises(LoomError, match=r"refused push: bad request: row ids of 'emb' outside this server's 5 rows"):
        client.call({"op": "push", "worker": "w0", "seq": 0}, bad)
    assert torch.equal(server.dense["w"], torch.ones(2, 3))
    assert client.call({"op": "stats"})[0]["applied"] == {}


def test_a_process_without_the_token_is_refused(served):
    _, _, port = served
    stranger = ServerClient(f"127.0.0.1:{port}", "guess", patience=1)
    with pytest.raises(LoomError, match="refused pull: not a member of this job"):
        stranger.call({"op": "pull", "names": ["w"]})
    stranger.close()


def test_a_missing_server_is_named_once_patience_runs_out():
    port = free_port()
    client = ServerClient(f"127.0.0.1:{port}", "secret", deadline=0.5, patience=1.5)
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=f"parameter server 127.0.0.1:{port} did not answer for 1.5s"):
        client.call({"op": "pull", "names": ["w"]})
    assert time.monotonic() - start < 5
    client.close()


def test_a_restarted_server_is_waited_for():
    port = free_port()
    client = ServerClient(f"127.0.0.1:{port}", "secret", deadline=1, patience=20)

    def start_later():
        time.sleep(1.0)
        late.serve(port)

    late = ParameterServer("secret", {"w": torch.ones(1)})
    threading.Thread(target=start_later).start()
    _, pulled = client.call({"op": "pull", "names": ["w"]})
    assert torch.equal(pulled["w"], torch.ones(1))
    client.close()
    late.stop()


def test_the_server_knows_when_every_worker_is_done_and_a_restart_remembers(served, tmp_path):
    server, client, _ = served
    push(client, {"worker": "worker-3.99", "index": 3, "seq": 0}, {"grad/w": torch.ones(2, 3)})  # joined beyond 2
    for worker in (0, 1):
        client.call({"op": "finish", "worker": worker, "code": 0})
    assert not server.all_finished(2)  # worker 3 joined and is still training
    server.save(tmp_path / "state.safetensors")
    restarted = ParameterServer.restore("secret", tmp_path / "state.safetensors")
    assert (restarted.applied, restarted.progress, restarted.version) == ({"worker-3.99": 1}, {"3": 1}, 1)
    restarted.handle({"op": "finish", "worker": 3, "code": 1}, {})
    assert restarted.all_finished(2) and restarted.finished == {"0": 0, "1": 0, "3": 1}
    restarted.new_run()  # the job run again from this state: its workers have yet to finish
    assert not restarted.all_finished(2) and restarted.progress == {"3": 1}



def _share(client, index, round_, value, process="a"):
    return push(client, {"worker": f"worker-{index}.{process}", "index": index, "seq": round_, "sync": 2}, {"grad/w": torch.full((2, 3), value)})


def test_a_synchronous_round_is_applied_once_with_the_mean_of_its_shares(served):
    server, client, _ = served
    _share(client, 0, 0, 1.0)
    assert client.call({"op": "round", "round": 0})[0] == {"round": -1, "given": ["0"], "version": 0}  # waits for worker 1
    assert torch.equal(server.dense["w"], torch.ones(2, 3))
    _share(client, 0, 0, 9.0, process="b")  # worker 0's restarted process gives round 0 again: ignored
    _share(client, 1, 0, 3.0)
    assert client.call({"op": "round", "round": 0, "wait": 5})[0]["round"] == 0
    assert torch.equal(server.dense["w"], torch.zeros(2, 3))  # 1 - 0.5 * mean(1, 3)
    assert not _share(client, 1, 0, 3.0)  # a retry: acknowledged, not applied
    client.call({"op": "finish", "worker": 1, "code": 0})
    _share(client, 0, 1, 2.0)  # worker 1 is done: the round no longer waits for it
    assert server.round == 1 and server.version == 2 and torch.equal(server.dense["w"], -torch.ones(2, 3))


def test_a_server_restarted_mid_round_gets_the_lost_shares_again(served, tmp_path):
    server, client, _ = served
    _share(client, 0, 0, 1.0)
    server.save(tmp_path / "state.safetensors")  # worker 0's share is in the checkpoint, worker 1's will not be
    _share(client, 1, 0, 3.0)
    restarted = ParameterServer.restore("secret", tmp_path / "state.safetensors")
    assert restarted.wait_for_round(0, timeout=0) == {"round": -1, "given": ["0"]}  # worker 1 sends its share again
    push(restarted, {"worker": "worker-1.a", "index": 1, "seq": 0, "sync": 2}, {"grad/w": torch.full((2, 3), 3.0)})
    assert restarted.round == 0 and torch.equal(restarted.dense["w"], server.dense["w"])
    older = ParameterServer.restore("secret", tmp_path / "state.safetensors")
    push(older, {"worker": "worker-1.a", "index": 1, "seq": 1, "sync": 2}, {"grad/w": torch.ones(2, 3)})
    push(older, {"worker": "worker-0.a", "index": 0, "seq": 1, "sync": 2}, {"grad/w": torch.ones(2, 3)})
    assert older.round == 1 and older.version == 1  # round 0's lost shares never come: the workers moved on


@pytest.fixture
def two_servers():
    servers = [ParameterServer("secret", {"w": torch.ones(2)}, {}, ServerOptimizer("SGD", [{"lr": 1.0}])) for _ in range(2)]
    clients = [ServerClient(f"127.0.0.1:{s.serve(free_port())}", "secret", patience=2) for s in servers]
    yield servers, clients
    for server, client in zip(servers, clients):
        client.close()
        server.stop()


@pytest.mark.parametrize(
    "staged_on, committed_on, applied",
    [
        ((0, 1), (0,), True),  # died between its commits: committed on the other server too
        ((0, 1), (), True),  # died after staging everywhere: the push is whole, so it is applied
        ((0,), (), False),  # died while staging: aborted where it was staged
    ],
)
def test_a_push_cut_short_by_a_dead_worker_is_settled_on_every_server_or_none(two_servers, staged_on, committed_on, applied):
    servers, clients = two_servers
    push(clients[0], {"worker": "worker-1.7", "seq": 0, "parts": [0, 1]}, {"grad/w": torch.ones(2)})  # an earlier, whole push
    push(clients[1], {"worker": "worker-1.7", "seq": 0, "parts": [0, 1]}, {"grad/w": torch.ones(2)})
    for s in staged_on:
        clients[s].call({"op": "push", "worker": "worker-1.7", "seq": 1, "parts": [0, 1]}, {"grad/w": torch.ones(2)})
    for s in committed_on:
        clients[s].call({"op": "commit", "worker": "worker-1.7", "seq": 1})
    lines = settle(clients, "worker-1.7")
    assert lines == [f"push 1 of worker-1.7 applied on {'every server' if applied else 'none'} ({clients[0].address}, {clients[1].address})"]
    for server in servers:
        assert server.applied == {"worker-1.7": 2 if applied else 1} and not server._staged
        assert torch.equal(server.dense["w"], torch.full((2,), -1.0 if applied else 0.0))
    assert settle(clients, "worker-1.7") == []  # nothing left to settle


def test_a_commit_the_server_lost_in_a_restart_asks_for_the_push_again(served, tmp_path):
    server, client, _ = served
    client.call({"op": "push", "worker": "w0", "seq": 0}, {"grad/w": torch.ones(2, 3)})
    server.save(tmp_path / "state.safetensors")  # staged pushes are not state: a restart loses them
    restarted = ParameterServer.restore("secret", tmp_path / "state.safetensors")
    assert restarted.handle({"op": "commit", "worker": "w0", "seq": 0}, {})[0] == {"applied": False, "missing": True}
    assert push(restarted, {"worker": "w0", "seq": 0}, {"grad/w": torch.ones(2, 3)})  # the worker stages it again
    assert restarted.handle({"op": "commit", "worker": "w0", "seq": 0}, {})[0] == {"applied": False, "missing": False}
    _, pulled = client.call({"op": "commit", "worker": "w0", "seq": 0, "names": ["w"]})  # commit, then read
    assert torch.equal(pulled["w"], torch.full((2, 3), 0.5)) and torch.equal(restarted.dense["w"], pulled["w"])


def test_a_slow_save_spaces_out_the_next_ones():
    """A large shard that takes 0.5 s to save is saved every 10 s, not every 2 s: saving stays under 1/20 of the time."""
    from loom.strategies.parameter_server.serve import save_interval

    assert save_interval(2.0, 0.01) == 2.0
    assert save_interval(2.0, 0.5) == 10.0
