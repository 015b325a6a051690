"""reduce, gather and barrier over parameter-server workers, met at server 0."""

import threading

import pytest
import torch

from loom.errors import LoomError
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from tests.helpers import free_port


@pytest.fixture
def server():
    served = ParameterServer("job-token")
    yield served, f"127.0.0.1:{served.serve(free_port())}"
    served.stop()


def _on_workers(address, work, count=2):
    """``work(strategy)`` for ``count`` workers at once; their results, in worker order."""
    results = [None] * count

    def run(worker):
        strategy = ParameterServerStrategy([address], token="job-token", worker=worker, num_workers=count, timeout=20)
        results[worker] = work(strategy)
        strategy.shutdown()

    threads = [threading.Thread(target=run, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_reduce_gather_and_barrier_cover_every_worker(server):
    def work(strategy):
        mine = strategy.replica_id + 1
        strategy.barrier()
        return (
            strategy.reduce(mine, "sum"),
            strategy.reduce(torch.tensor([mine, -mine]), "max").tolist(),
            strategy.reduce(mine, "mean"),
            strategy.gather(torch.full((mine,), mine)).tolist(),  # sizes differ
        )

    assert _on_workers(server[1], work) == [(3, [2, -1], 1.5, [1, 2, 2])] * 2


def test_a_restarted_worker_meets_the_others_at_their_next_collective(server):
    _, address = server
    assert _on_workers(address, lambda s: s.reduce(1, "sum")) == [2, 2]
    # new processes for both workers: they go on after their predecessors' last collective (not at #0 again)
    assert _on_workers(address, lambda s: s.reduce(s.replica_id + 10, "sum")) == [21, 21]


def test_a_worker_done_for_good_is_not_waited_for_and_a_missing_one_is_named(server):
    _, address = server
    alone = ParameterServerStrategy([address], token="job-token", worker=0, num_workers=2, timeout=1)
    with pytest.raises(LoomError, match=r"sum #0 over the parameter-server workers: worker\(s\) \[1\] did not get there within 1s"):
        alone.reduce(5, "sum")
    client = ServerClient(address, "job-token")
    client.call({"op": "finish", "worker": 1, "code": 0})  # its launcher: worker 1 is done for good
    assert alone.reduce(5, "sum") == 5
    client.close()
    alone.shutdown()


def test_an_unknown_reduce_op_is_named(server):
    strategy = ParameterServerStrategy([server[1]], token="job-token", worker=0, num_workers=1)
    with pytest.raises(ValueError, match="unknown reduce op 'avg'; use one of sum, mean, max, min, product"):
        strategy.reduce(1.0, "avg")
