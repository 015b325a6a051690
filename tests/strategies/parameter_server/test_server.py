"""A parameter server over gRPC: pulls, pushes applied once and whole, tokens, lost servers."""

import threading
import time

import pytest
import torch

from loom.errors import LoomError
from loom.strategies.parameter_server.client import ServerClient, ServerUnavailableError
from loom.strategies.parameter_server.optimizers import ServerOptimizer
from loom.strategies.parameter_server.server import ParameterServer
from tests.helpers import free_port


@pytest.fixture
def served():
    server = ParameterServer("secret", {"w": torch.ones(2, 3)}, {"emb": torch.zeros(5, 4)}, ServerOptimizer("sgd", lr=0.5))
    port = server.serve(free_port())
    client = ServerClient(f"127.0.0.1:{port}", "secret", patience=2)
    yield server, client, port
    client.close()
    server.stop()


def test_pull_push_and_rows(served):
    server, client, _ = served
    _, pulled = client.call({"op": "pull", "names": ["w"]})
    assert torch.equal(pulled["w"], torch.ones(2, 3))
    push = {"grad/w": torch.full((2, 3), 2.0), "rowids/emb": torch.tensor([1, 3, 1]), "rowgrad/emb": torch.ones(3, 4)}
    assert client.call({"op": "push", "worker": "w0", "seq": 0}, push)[0] == {"applied": True}
    assert torch.equal(server.dense["w"], torch.zeros(2, 3))  # 1 - 0.5 * 2
    _, rows = client.call({"op": "pull_rows", "table": "emb"}, {"ids": torch.tensor([1, 3, 0])})
    assert rows["rows"][:, 0].tolist() == [-1.0, -0.5, 0.0]  # row 1 pushed twice: gradients summed


def test_a_retried_push_is_applied_once(served):
    server, client, _ = served
    push = {"grad/w": torch.ones(2, 3)}
    for _ in range(3):  # the same sequence number: a retry after a lost reply
        client.call({"op": "push", "worker": "w0", "seq": 5}, push)
    client.call({"op": "push", "worker": "w1", "seq": 0}, push)
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
    client.call({"op": "push", "worker": "worker-3.99", "index": 3, "seq": 0}, {"grad/w": torch.ones(2, 3)})  # joined beyond 2
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
    push = {"op": "push", "worker": f"worker-{index}.{process}", "index": index, "seq": round_, "sync": 2}
    return client.call(push, {"grad/w": torch.full((2, 3), value)})[0]["applied"]


def test_a_synchronous_round_is_applied_once_with_the_mean_of_its_shares(served):
    server, client, _ = served
    _share(client, 0, 0, 1.0)
    assert client.call({"op": "round", "round": 0})[0] == {"round": -1, "given": ["0"]}  # waits for worker 1
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
    restarted.handle({"op": "push", "worker": "worker-1.a", "index": 1, "seq": 0, "sync": 2}, {"grad/w": torch.full((2, 3), 3.0)})
    assert restarted.round == 0 and torch.equal(restarted.dense["w"], server.dense["w"])
    older = ParameterServer.restore("secret", tmp_path / "state.safetensors")
    older.handle({"op": "push", "worker": "worker-1.a", "index": 1, "seq": 1, "sync": 2}, {"grad/w": torch.ones(2, 3)})
    older.handle({"op": "push", "worker": "worker-0.a", "index": 0, "seq": 1, "sync": 2}, {"grad/w": torch.ones(2, 3)})
    assert older.round == 1 and older.version == 1  # round 0's lost shares never come: the workers moved on
