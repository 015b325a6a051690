"""ParameterServerStrategy: one worker equals local training; several workers train on their own."""

import re
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.job_failure import JobFailedError, tell_servers
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from tests.helpers import free_port
from tests.scripts.clicks import Clicks


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 50, (16, 5), generator=g)
        yield ids, (ids % 7 == 0).any(1).float()


def _run_workers(work, count=2):
    """``work(worker)`` on ``count`` threads at once, as workers of one job."""
    threads = [threading.Thread(target=work, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


@pytest.fixture
def servers():
    started = [ParameterServer("job-token") for _ in range(2)]
    addresses = [f"127.0.0.1:{s.serve(free_port())}" for s in started]
    yield addresses
    for s in started:
        s.stop()


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)])
def test_one_worker_on_two_servers_equals_local_training(servers, make_opt):
    """For SGD and Adagrad the servers step only the pushed rows, which equals torch's dense step
    (untouched rows stay put); momentum and Adam: test_exact_optimizers.py."""
    local = Clicks()
    local_opt = make_opt(local.parameters())
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    remote, opt = strategy.prepare(Clicks(), make_opt)
    for ids, y in batches(15):
        for model, optimizer in ((local, local_opt), (remote, opt)):
            F.binary_cross_entropy_with_logits(model(ids), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for name, p in local.mlp.named_parameters():
        torch.testing.assert_close(dict(remote.mlp.named_parameters())[name].detach(), p.detach(), rtol=1e-5, atol=1e-6)
    table = strategy.variables.pull_rows("bag", torch.arange(50))
    torch.testing.assert_close(table, local.bag.weight.detach(), rtol=1e-5, atol=1e-6)
    assert strategy.variables.pull_rows("bag", torch.tensor([], dtype=torch.long)).shape == (0, table.shape[1])
    strategy.shutdown()


@pytest.mark.parametrize("make_opt, prefetch", [(lambda p: torch.optim.SGD(p, lr=0.1), False),
                                                (lambda p: torch.optim.Adagrad(p, lr=0.1), False),
                                                (lambda p: torch.optim.Adagrad(p, lr=0.1), True)])  # fmt: skip
def test_two_synchronous_workers_equal_one_on_the_global_batch(servers, make_opt, prefetch):
    """Each step the servers apply the mean of both workers' gradients once: local training on
    the whole batch, although each worker saw half of it. Rows prefetched for the next batch
    are read after the round, so prefetching changes nothing (read before, they would be stale)."""
    local = Clicks()
    local_opt = make_opt(local.parameters())
    for ids, y in batches(15):
        F.binary_cross_entropy_with_logits(local(ids), y).backward()
        local_opt.step()
        local_opt.zero_grad()
    tables, built = {}, [Clicks(), Clicks()]  # built here: threads would interleave draws from the global RNG

    def work(worker):
        strategy = ParameterServerStrategy(servers, token="job-token", worker=worker, num_workers=2, synchronous=True)
        model, opt = strategy.prepare(built[worker], make_opt)
        pulled_by = _record_pulls(strategy.variables)
        half = slice(8 * worker, 8 * worker + 8)
        data = list(batches(15))
        for step, (ids, y) in enumerate(data):
            if prefetch and step + 1 < len(data):
                strategy.prefetch(model, {"bag": data[step + 1][0][half]})
            F.binary_cross_entropy_with_logits(model(ids[half]), y[half]).backward()
            opt.step()
            opt.zero_grad()
        if prefetch:  # the worker pulled rows for its first batch only; the others came with each round's read
            assert pulled_by == [threading.current_thread().name], pulled_by
        tables[worker] = (strategy.variables.pull_rows("bag", torch.arange(50)), dict(model.mlp.named_parameters()))
        strategy.shutdown()

    _run_workers(work)
    for table, mlp in tables.values():  # both workers end with the same parameters: local training's
        torch.testing.assert_close(table, local.bag.weight.detach(), rtol=1e-5, atol=1e-6)
        for name, p in local.mlp.named_parameters():
            torch.testing.assert_close(mlp[name].detach(), p.detach(), rtol=1e-5, atol=1e-6)
    assert len(tables) == 2


def _record_pulls(variables):
    """The names of the threads that pull rows from now on."""
    names, pull = [], variables.pull_rows

    def recording(*args):
        names.append(threading.current_thread().name)
        return pull(*args)

    variables.pull_rows = recording
    return names


def test_asynchronous_prefetch_comes_with_the_commit_after_the_push_and_a_table_not_in_the_model_is_named(servers):
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    model, opt = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.1))
    pulled_by = _record_pulls(strategy.variables)
    ops = []
    for client in strategy.variables.clients:
        client.send = (lambda send: lambda fields, tensors=None: ops.append(fields["op"]) or send(fields, tensors))(client.send)
    (ids, y), (after, _) = batches(2)
    strategy.prefetch(model, {"bag": after})
    F.binary_cross_entropy_with_logits(model(ids), y).backward()
    opt.step()  # stage and commit on both servers; each commit brings its rows of the next batch
    assert len(pulled_by) == 1 and sorted(ops) == ["commit", "commit", "pull_rows", "pull_rows", "push", "push"], ops
    rows = model.bag.ahead[-1][1]
    torch.testing.assert_close(rows, strategy.variables.pull_rows("bag", torch.unique(after)), rtol=0, atol=0)  # after the push
    model(after)
    assert len(pulled_by) == 2  # only the check's: the forward pass used the prefetched rows
    with pytest.raises(ValueError, match=r"prefetch: the model has no table 'table'; its tables are \['bag'\]"):
        strategy.prefetch(model, {"table": ids})
    strategy.shutdown()


def test_synchronous_and_staleness_exclude_each_other(servers):
    with pytest.raises(ValueError, match="synchronous training has no staleness: pass one of"):
        ParameterServerStrategy(servers, token="job-token", staleness=2, synchronous=True)


def test_two_workers_train_on_their_own_and_the_loss_falls(servers):
    losses = {}

    def work(worker):
        strategy = ParameterServerStrategy(servers, token="job-token", worker=worker, num_workers=2)
        model, opt = strategy.prepare(Clicks(), lambda p: torch.optim.Adam(p, lr=0.05))
        seen = []
        for ids, y in batches(60, seed=worker):
            loss = F.binary_cross_entropy_with_logits(model(ids), y)
            strategy.backward(loss)
            opt.step()
            opt.zero_grad()
            seen.append(loss.item())
        losses[worker] = seen
        strategy.shutdown()

    _run_workers(work)
    for worker, seen in losses.items():
        assert sum(seen[-10:]) < 0.7 * sum(seen[:10]), f"worker {worker}: {seen[:3]} ... {seen[-3:]}"
    assert len(losses) == 2


def test_optimizers_the_servers_cannot_run_are_named(servers):
    strategy = ParameterServerStrategy(servers, token="job-token")
    with pytest.raises(ValueError, match="NAdam cannot run on the parameter servers; use SGD"):
        strategy.prepare(Clicks(), lambda p: torch.optim.NAdam(p))


def _race(servers, staleness, steps=30):
    """Two workers, one 10x slower; the order in which their steps finish."""
    finished = []
    lock, start = threading.Lock(), threading.Barrier(2)

    def work(worker):
        strategy = ParameterServerStrategy(servers, token="job-token", worker=worker, num_workers=2, staleness=staleness)
        model, opt = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.05))
        start.wait()  # both step from the same moment
        for ids, y in batches(steps, seed=worker):
            F.binary_cross_entropy_with_logits(model(ids), y).backward()
            if worker == 1:
                time.sleep(0.02)  # the straggler
            opt.step()
            opt.zero_grad()
            with lock:
                finished.append(worker)
        strategy.shutdown()

    _run_workers(work)
    assert len(finished) == 2 * steps
    return finished


def _widest_lead(finished):
    counts, lead = [0, 0], 0
    for worker in finished:
        counts[worker] += 1
        lead = max(lead, counts[0] - counts[1])
    return lead


@pytest.mark.parametrize("staleness", [0, 3])
def test_bounded_staleness_keeps_the_fast_worker_within_k_steps(servers, staleness):
    assert _widest_lead(_race(servers, staleness)) <= staleness + 1


def test_asynchronous_workers_do_not_wait_for_a_straggler(servers):
    assert _widest_lead(_race(servers, None)) > 10


def test_servers_record_how_stale_each_push_was(servers):
    _race(servers, None, steps=10)
    from loom.strategies.parameter_server.client import ServerClient

    stats = ServerClient(servers[0], "job-token").call({"op": "stats"})[0]
    histogram = {int(k): v for k, v in stats["staleness"].items()}
    assert sum(histogram.values()) == stats["version"] == 20
    assert max(histogram) >= 1  # the straggler computed on parameters others had since updated


def test_the_chief_reports_the_jobs_progress(servers):
    _race(servers, None, steps=12)
    chief = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=2)
    chief.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.05))  # variables exist: joins as chief
    report = chief.job_report()
    assert report["global_step"] == 24  # both workers' steps, as the servers saw them
    assert report["staleness_max"] >= report["staleness_p90"] >= report["staleness_p50"] >= 0
    assert report["worker0_steps_per_sec"] > 0 and report["worker1_steps_per_sec"] > 0
    again = chief.job_report()  # another caller (TensorBoard after the progress bar) sees the same window
    assert 0 < again["updates_per_sec"] <= report["updates_per_sec"] and again["global_step"] == 24
    chief.rate_window = 0.05
    time.sleep(0.1)
    assert chief.job_report()["updates_per_sec"] == 0  # nothing happened in the last window
    chief.shutdown()


def test_fit_under_parameter_servers_writes_the_job_report_to_tensorboard(servers, tmp_path):
    import loom
    from loom.train import TensorBoard

    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    ids = torch.randint(0, 50, (64, 5))
    data = torch.utils.data.TensorDataset(ids, (ids % 7 == 0).any(1).float())
    loom.fit(Clicks(), F.binary_cross_entropy_with_logits, lambda p: torch.optim.SGD(p, lr=0.1), data, epochs=2,
             batch_size=16, strategy=strategy, progress=False, callbacks=[TensorBoard(str(tmp_path), every_steps=2)])  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path)).Reload()
    assert {"job/global_step", "job/updates_per_sec", "job/worker0_steps_per_sec"} <= set(events.Tags()["scalars"])
    assert events.Scalars("job/global_step")[-1].value == 8
    strategy.shutdown()


def test_under_scope_no_worker_allocates_a_table(servers):
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    with strategy.scope():
        built = Clicks()
    assert built.bag.weight.is_meta
    model, opt = strategy.prepare(built, lambda p: torch.optim.Adagrad(p, lr=0.1))
    assert all(not p.is_meta and p.numel() < 50 * 8 for p in model.parameters())  # the table lives on the servers
    table = strategy.variables.pull_rows("bag", torch.arange(50))
    assert table.shape == (50, 8) and 0.8 < table.std().item() < 1.2  # drawn there, N(0, 1)
    losses = []
    for ids, y in batches(40):
        loss = F.binary_cross_entropy_with_logits(model(ids), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-10:]) < sum(losses[:10])
    strategy.shutdown()


def test_evaluation_keeps_no_pulled_rows(servers):
    strategy = ParameterServerStrategy(servers, token="job-token")
    model, _ = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.1))
    with torch.no_grad():
        for ids, _ in batches(5):
            model(ids)
    assert model.bag.touched == []  # rows pulled for evaluation are not held for a push
    strategy.shutdown()


def test_a_restarted_worker_resumes_its_clock_and_does_not_stall_the_others(servers):
    """With staleness K, a restarted worker goes on from its predecessor's step count, so the
    others need not wait for it to replay every step it had done."""
    k = 2

    def worker(index):
        strategy = ParameterServerStrategy(servers, token="job-token", worker=index, num_workers=2, staleness=k)
        model, opt = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.05))
        return strategy, model, opt

    def steps(strategy, model, opt, n):
        for ids, y in batches(n, seed=strategy.replica_id):
            F.binary_cross_entropy_with_logits(model(ids), y).backward()
            opt.step()
            opt.zero_grad()

    chief, lost = worker(0), worker(1)
    for _ in range(10):  # in lockstep, so neither waits long
        steps(*chief, 1)
        steps(*lost, 1)
    lost[0].shutdown()  # worker 1 dies; its successor starts
    successor = worker(1)
    assert successor[0].step == 10
    steps(*successor, 1)
    ahead = threading.Thread(target=steps, args=(*chief, k + 1))  # to step 13: within K of the successor's 11
    ahead.start()
    ahead.join(timeout=10)
    assert not ahead.is_alive(), "the chief waits for the restarted worker to replay its steps"
    assert chief[0].step == 10 + k + 1
    for strategy, _, _ in (chief, successor):
        strategy.shutdown()


def test_a_worker_waiting_for_the_chief_stops_at_once_when_a_server_is_told_the_job_failed(servers):
    """What a launcher on another machine sends when the chief fails for good (job_failure.py):
    the worker stops naming the chief, long before its timeout; the launchers' reports still get through."""
    reason = "worker 0, the chief (pid 1 on host-a), failed: ValueError: NAdam cannot run on the parameter servers"
    assert tell_servers(servers, "job-token", None, reason) == []
    strategy = ParameterServerStrategy(servers, token="job-token", worker=1, num_workers=2, timeout=300)
    started = time.monotonic()
    with pytest.raises(JobFailedError, match=rf"^the job failed: {re.escape(reason)}; this worker stops$"):
        strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.1))
    assert time.monotonic() - started < 30
    client = ServerClient(servers[1], "job-token")
    assert client.call({"op": "finish", "worker": 1, "code": 1}) == ({}, {})
    assert "version" in client.call({"op": "stats"})[0]
    client.close()
