"""ClusterCoordinator's parts without a job: the schedule at server 0, a step's update applied once
whoever runs it (across a server restart too), results as they travel, and the refusals."""

import pytest
import torch

from loom import ClusterCoordinator, OneDeviceStrategy, ParameterServerStrategy
from loom.errors import LoomError
from loom.strategies.parameter_server import coordinator as coordinator_module
from loom.strategies.parameter_server.coordinator import PerWorkerDataset, _pack, _unpack
from loom.strategies.parameter_server.optimizers import ServerOptimizer
from loom.strategies.parameter_server.schedule import Schedule
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.partitioner import place
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.variables import ShardedVariables
from loom.strategies.parameter_server.wire import WireError
from tests.helpers import free_port
from tests.strategies.parameter_server.test_server import push


def take(schedule, worker, pid, below=10):
    return schedule.handle({"do": "take", "worker": worker, "pid": pid, "below": below}, {}, {})[0]


def status(schedule, below, want=()):
    return schedule.handle({"do": "status", "below": below, "want": list(want)}, {}, {"2": -9})


def test_a_dead_workers_step_goes_back_to_the_front_of_the_queue():
    schedule = Schedule()
    schedule.handle({"do": "add", "first": 0, "names": ["step"] * 4}, {}, {})
    assert take(schedule, 1, 100)["run"] == 0 and take(schedule, 2, 200)["run"] == 1
    assert take(schedule, 2, 200)["run"] == 1  # its reply was lost: the same step again, never a second one
    assert take(schedule, 2, 201) == {"run": 1, "name": "step", "again": True}  # worker 2's successor: its predecessor's step first
    schedule.handle({"do": "done", "number": 0, "worker": 1, "result": {"value": 7}}, {}, {})
    assert take(schedule, 1, 100)["run"] == 2
    schedule.settle({"1"})  # worker 1 is done for good: step 2 is run by another
    assert take(schedule, 3, 300)["run"] == 2
    assert take(schedule, 3, 300, below=2) == {"run": 2, "name": "step", "again": True}
    fields, _ = status(schedule, 4, want=[0])
    assert fields["left"] == 3 and fields["results"] == {"0": {"value": 7}} and fields["unknown"] == 0
    assert fields["finished"] == {"2": -9}  # as the launchers told server 0


def test_a_worker_takes_only_steps_its_script_has_scheduled_and_the_first_error_is_everyones():
    schedule = Schedule()
    schedule.handle({"do": "add", "first": 0, "names": ["a", "b"]}, {}, {})
    assert take(schedule, 1, 1, below=1)["run"] == 0
    assert "run" not in take(schedule, 2, 2, below=1)  # step 1 is beyond what worker 2 has scheduled
    schedule.handle({"do": "done", "number": 0, "worker": 1, "error": "ValueError: bad batch"}, {}, {})
    fields, _ = status(schedule, 2)
    assert fields["error"] == "a (scheduled function 0) failed on worker 1: ValueError: bad batch"
    assert status(Schedule(), 3)[0]["unknown"] == 3  # a server 0 that lost the schedule knows none of them


def test_a_steps_update_is_applied_once_whoever_runs_it_and_after_a_server_restart(tmp_path):
    server = ParameterServer("secret", {"w": torch.zeros(2)}, {}, ServerOptimizer("SGD", [{"lr": 1.0}]))
    grad = {"grad/w": -torch.ones(2)}
    assert push(server, {"worker": "worker-1.10", "seq": 0, "closure": "4.0"}, grad)
    assert not push(server, {"worker": "worker-2.20", "seq": 0, "closure": "4.0"}, grad)  # step 4 run again elsewhere
    assert push(server, {"worker": "worker-2.20", "seq": 1, "closure": "5.0"}, grad)
    server.save(tmp_path / "state.safetensors")
    restarted = ParameterServer.restore("secret", tmp_path / "state.safetensors")
    assert not push(restarted, {"worker": "worker-2.21", "seq": 0, "closure": "5.0"}, grad)
    assert restarted.dense["w"].tolist() == [2.0, 2.0]
    restarted.new_run()  # a new run of the job numbers its steps from 0 again
    assert push(restarted, {"worker": "worker-1.11", "seq": 0, "closure": "4.0"}, grad)


def test_a_result_travels_as_json_and_tensors():
    tensors = {}
    value = {"loss": torch.tensor(0.5), "counts": (torch.ones(2), 3), "tag": ["a", None, 1.5]}
    packed = _pack(value, tensors)
    back = _unpack(packed, {key.split("/", 1)[1]: t for key, t in tensors.items()})
    assert back["loss"].item() == 0.5 and torch.equal(back["counts"][0], torch.ones(2)) and back["counts"][1] == 3
    assert back["tag"] == ["a", None, 1.5] and isinstance(back["counts"], tuple)
    with pytest.raises(TypeError, match="a scheduled function returns tensors, numbers, strings, None, or lists, tuples and dicts"):
        _pack(object(), {})


def _strategy(**options):
    return ParameterServerStrategy(servers=["127.0.0.1:1"], token="t", **{"worker": 0, "num_workers": 3, **options})


def test_what_a_coordinator_cannot_do_is_refused_in_one_line():
    with pytest.raises(TypeError, match="ClusterCoordinator takes a ParameterServerStrategy, not OneDeviceStrategy"):
        ClusterCoordinator(OneDeviceStrategy())
    with pytest.raises(ValueError, match="ClusterCoordinator runs asynchronous steps, as TF's does: leave out --sync and --staleness"):
        ClusterCoordinator(_strategy(synchronous=True))
    with pytest.raises(ValueError, match="ClusterCoordinator needs a chief that coordinates and at least one worker"):
        ClusterCoordinator(_strategy(num_workers=1))
    coordinator = ClusterCoordinator(_strategy(worker=1))  # a worker: nothing is sent when it schedules
    value = coordinator.schedule(lambda: 1)
    with pytest.raises(TypeError, match="coordinator.schedule takes no RemoteValue arguments in loom: pass value.fetch"):
        coordinator.schedule(print, args=(value,))
    on_coordinator = iter(PerWorkerDataset(None))
    with pytest.raises(LoomError, match="a per-worker iterator is read on the workers, not on the coordinator"):
        next(on_coordinator)


def test_each_worker_that_runs_steps_builds_its_own_input_pipeline():
    seen = []
    for worker in (1, 2):
        coordinator = ClusterCoordinator(_strategy(worker=worker))
        coordinator.create_per_worker_dataset(lambda ctx: seen.append((ctx.input_pipeline_id, ctx.num_input_pipelines)) or [])
        coordinator.create_per_worker_dataset(lambda: coordinator.strategy.distribute_datasets_from_function(
            lambda ctx: seen.append((ctx.input_pipeline_id, ctx.get_per_replica_batch_size(32))) or []))  # fmt: skip
    assert seen == [(0, 2), (0, 32), (1, 2), (1, 32)]  # the chief (worker 0) runs no steps and builds none
    assert ClusterCoordinator(_strategy()).create_per_worker_dataset(lambda: 1 / 0)._dataset is None


def test_a_coordinator_without_workers_and_a_worker_without_its_coordinator_stop_in_one_line():
    coordinator = ClusterCoordinator(_strategy())
    with pytest.raises(LoomError, match="every worker has ended with 2 scheduled functions not run: each worker's script must"):
        coordinator._check_alive({"unknown": 0, "left": 2, "finished": {"1": 0, "2": -9}})
    with pytest.raises(LoomError, match="parameter server 0 no longer knows 3 scheduled functions: it restarted"):
        coordinator._check_alive({"unknown": 3, "left": 3, "finished": {}})
    coordinator._check_alive({"unknown": 0, "left": 2, "finished": {"2": -9}})  # worker 1 is left to run them
    worker = ClusterCoordinator(_strategy(worker=1))
    worker._check_alive({"unknown": 0, "left": 1, "finished": {"0": 0}})  # the chief ended well: its steps are still queued
    with pytest.raises(LoomError, match=r"the coordinator \(worker 0, the chief\) ended \(exit code 1\) with 1 of this worker's"):
        worker._check_alive({"unknown": 0, "left": 1, "finished": {"0": 1}})


def test_a_worker_hears_how_long_the_coordinator_has_been_silent_and_gives_up_past_the_timeout(monkeypatch):
    schedule = Schedule()
    assert take(schedule, 1, 100, below=1)["coordinator_silent"] is None  # not heard yet: the variables' wait covers that
    schedule.handle({"do": "add", "first": 0, "names": ["a"]}, {}, {})
    schedule.heard -= 40.0  # as if 40 s had passed since
    assert 40.0 <= take(schedule, 2, 200, below=0)["coordinator_silent"] < 41.0
    schedule.handle({"do": "beat"}, {}, {})  # the coordinator's thread says it is alive while it schedules nothing
    assert take(schedule, 2, 200, below=0)["coordinator_silent"] < 1.0
    worker = ClusterCoordinator(_strategy(worker=1))
    worker.strategy.timeout = 30.0
    worker._check_alive({"unknown": 1, "left": 1, "finished": {}, "coordinator_silent": 29.0})  # within the timeout
    worker._check_alive({"unknown": 0, "left": 1, "finished": {}, "coordinator_silent": 99.0})  # its steps are all queued
    told = []
    monkeypatch.setattr(coordinator_module, "tell_servers", lambda servers, token, tls, reason: told.append(reason) or [])
    with pytest.raises(LoomError, match=r"the coordinator \(worker 0, the chief\) has not been heard from for 31s, past the job's timeout \(30s\)"):
        worker._check_alive({"unknown": 1, "left": 1, "finished": {}, "coordinator_silent": 31.0})
    assert told == ["worker 1 stopped the job: the coordinator (worker 0, the chief) has not been heard from for 31s, past the job's "
                    "timeout (30s): its process or machine is gone"]  # fmt: skip


def test_a_worker_gives_a_result_and_takes_the_next_step_in_one_request_and_none_is_not_kept():
    schedule = Schedule()
    schedule.handle({"do": "add", "first": 0, "names": ["step"] * 3}, {}, {})
    assert take(schedule, 1, 100)["run"] == 0
    asking = {"worker": 1, "pid": 100, "below": 3}
    reply, _ = schedule.handle({"do": "done", "number": 0, "result": {"value": None}, **asking}, {}, {})
    assert reply == {"run": 1, "name": "step", "again": False} and schedule.results == {}  # a None result: done, nothing kept
    reply, _ = schedule.handle({"do": "done", "number": 1, "result": {"tensor": "0"}, **asking}, {"r/0": torch.ones(1)}, {})
    assert reply == {"run": 2, "name": "step", "again": False}
    fields, tensors = status(schedule, 3, want=[0, 1])
    assert fields["results"] == {"0": {"value": None}, "1": {"tensor": "0"}} and torch.equal(tensors["r/1/0"], torch.ones(1))
    assert fields["left"] == 1 and schedule.done_below == 2 and not schedule.done_beyond
    with pytest.raises(WireError, match="schedule add: function 5 after 3 functions"):
        schedule.handle({"do": "add", "first": 5, "names": ["step"]}, {}, {})


def test_a_step_run_again_pushes_only_what_its_dead_run_did_not_apply():
    """Its first push was applied (on every server it was for: the launcher settled it), so the
    new run sends none of it, wherever its own batch's rows would go; its second push goes."""
    server = ParameterServer("secret", {"w": torch.zeros(2)}, {}, ServerOptimizer("SGD", [{"lr": 1.0}]))
    client = ServerClient(f"127.0.0.1:{server.serve(free_port())}", "secret", patience=2)
    try:
        assert push(client, {"worker": "worker-2.20", "seq": 0, "closure": "4.0"}, {"grad/w": -torch.ones(2)})
        assert client.call({"op": "closures", "closure": 4})[0]["applied"] == ["4.0"]
        variables = ShardedVariables([client], place({"w": 8}, {}, 1), "worker-1.10", 1)
        variables.rerunning(4)
        pulled, _ = variables.push({"w": -torch.ones(2)}, {}, then_pull=["w"])
        assert pulled["w"].tolist() == [1.0, 1.0] and variables.clock == 0  # not pushed: read as after it
        pulled, _ = variables.push({"w": -torch.ones(2)}, {}, then_pull=["w"])
        assert pulled["w"].tolist() == [2.0, 2.0] and client.call({"op": "closures", "closure": 4})[0]["applied"] == ["4.0", "4.1"]
    finally:
        client.close()
        server.stop()
