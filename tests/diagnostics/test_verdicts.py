"""The breakdown and its verdict on jobs built to be bound by one thing each, on 2 gloo ranks.

One launched job runs every scenario (a fresh strategy each, on the same process group).
The slow parts are sleeps, so the verdicts hold on a loaded machine: what a scenario makes
slow is time the recorder must put in the right place, whatever the CPU does meanwhile.
"""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tests.helpers import run_ranks

pytestmark = pytest.mark.xdist_group("verdicts")  # its tests share one launched job

SLEEP = 0.04
COMM_DELAY = 0.12  # the slow link's: beside it a loaded machine's few ms of compute are no straggler (40 ms made one)
COMPUTE = 0.3  # the compute-bound job's forward: well above what a loaded machine adds to a tiny all-reduce
STRAGGLE = 0.1  # what the straggler's forward adds
STEPS = 6
EPOCHS = 3  # fit's table: after the first (its verdict is new) and the last, not the one between


class Sleepy(nn.Module):
    """A tiny model whose forward takes ``seconds`` (device time, as the recorder sees it)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.layer = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.layer(x)


def _data(n: int = 16 * (STEPS + 1)) -> TensorDataset:
    return TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))


def _slow_read(sample):
    time.sleep(SLEEP / 4)
    return sample


def _delayed_allreduce(state, bucket):
    """The default all-reduce, then a wait: a slow link, as the job sees it."""
    buffer = bucket.buffer().div_(dist.get_world_size())

    def late(fut):
        time.sleep(COMM_DELAY)
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(late)


SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731


def _compute_bound_fit(loom, log_dir: str) -> dict:
    """fit's report runs at each epoch's end (strategy.report() after it finds no steps)."""
    strategy = loom.MirroredStrategy()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        loom.fit(Sleepy(COMPUTE), F.cross_entropy, SGD, _data(), epochs=EPOCHS, batch_size=16, strategy=strategy, log_dir=log_dir)
    return {"printed": printed.getvalue(), "fit_empty_after": strategy.report(show=False).verdict.kind}


def _input_bound_train_step(loom):
    """A pipeline whose map is slow, through train_step: the verdict names the stage."""
    from loom.data import from_tensors

    strategy = loom.MirroredStrategy()
    x, y = _data().tensors
    model, opt = strategy.prepare(Sleepy(0.0), SGD)
    step = strategy.train_step(model, F.cross_entropy, opt)
    loader = strategy.distribute(from_tensors(x, y).map(_slow_read, name="slow_read").batch(16))
    for xb, yb in loader:
        step(xb, yb)
    return strategy.report(loader=loader, show=False)


def _communication_bound_train_step(loom):
    """A delay in the comm hook, through train_step."""
    strategy = loom.MirroredStrategy()
    model, opt = strategy.prepare(Sleepy(0.0), SGD)
    model.register_comm_hook(None, _delayed_allreduce)
    step = strategy.train_step(model, F.cross_entropy, opt)
    for xb, yb in strategy.distribute(_data(), batch_size=16):
        step(xb, yb)
    return strategy.report(show=False)


def _straggler_bound_eager(loom):
    """Rank 1 computes longer, in the eager loop."""
    strategy = loom.MirroredStrategy()
    model, opt = strategy.prepare(Sleepy(STRAGGLE if strategy.replica_id == 1 else 0.0), SGD)
    for xb, yb in strategy.distribute(_data(), batch_size=16):
        strategy.backward(F.cross_entropy(model(xb), yb))
        opt.step()
        opt.zero_grad()
    return strategy.report(show=False)


def _scenarios(log_dir: str) -> dict:
    """Every scenario on a fresh strategy sharing the process group; each one's DDP model is
    gone before the next (a DDP reducer left to interpreter teardown can deadlock destroying
    the group, which loom's launched workers avoid by leaving with os._exit)."""
    import faulthandler
    import gc
    import sys

    import loom

    faulthandler.dump_traceback_later(100, exit=True, file=sys.stderr)  # a stuck rank shows where, before the test's timeout
    results = _compute_bound_fit(loom, log_dir)
    results["input"] = _input_bound_train_step(loom)
    results["comm"] = _communication_bound_train_step(loom)
    results["straggler"] = _straggler_bound_eager(loom)
    gc.collect()
    loom.MirroredStrategy().barrier()
    faulthandler.cancel_dump_traceback_later()
    return results


@pytest.fixture(scope="session")
def job(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("verdicts")
    return run_ranks(_scenarios, 2, str(log_dir), timeout=120), log_dir


def test_compute_bound_job_gets_no_false_verdict_and_fit_writes_every_epoch_to_tensorboard(job):
    results, log_dir = job
    for epoch in range(1, EPOCHS + 1):
        saved = (log_dir / "breakdown" / f"breakdown-{epoch}.json").read_text()
        assert '"kind": "compute-bound"' in saved and "tensor cores" not in saved, saved
        assert (log_dir / "breakdown" / f"breakdown-{epoch}.png").stat().st_size > 1000
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # fit's own, and the breakdown's apart:
    assert len(list((log_dir / "breakdown").glob("events.out.tfevents.*"))) == EPOCHS  # one each epoch, printed or not
    assert results[0]["fit_empty_after"] == "no steps"  # fit's report started a new window


def test_input_bound_names_the_slow_stage(job):
    for report in (r["input"] for r in job[0]):
        assert report.verdict.kind == "input-bound", report.table()
        assert "'slow_read'" in report.verdict.message
        assert all(r.steps == STEPS and r.seconds["input"] > SLEEP for r in report.ranks), report.table()


def test_communication_bound_quotes_bytes_and_bandwidth_and_advises_nothing_that_cannot_pay(job):
    """A tiny model's gradient behind a slow comm hook: halving its bytes would save microseconds."""
    report = job[0][0]["comm"]
    assert report.verdict.kind == "communication-bound", report.table()
    assert "bytes per step" in report.verdict.message and "/s" in report.verdict.message
    assert "waiting for a slower peer or the comm hook" in report.verdict.message
    assert "compression=" not in report.verdict.message and "No fix is predicted to save 10% of the step" in report.verdict.message
    assert report.bandwidth and report.bandwidth > 0
    assert all(r.seconds["comm"] > 0.8 * COMM_DELAY for r in report.ranks), report.table()


def test_straggler_bound_names_the_sleeping_rank(job):
    report = job[0][0]["straggler"]
    assert report.verdict.kind == "straggler-bound", report.table()
    assert report.verdict.rank == 1
    assert "rank 1 (host " in report.verdict.message
    assert report.ranks[0].seconds["comm"] > 0.8 * STRAGGLE  # rank 0 waited for it in the all-reduce
    assert report.ranks[1].seconds["compute"] > STRAGGLE


def test_fit_prints_the_table_on_the_chief_when_the_verdict_is_new_and_at_the_end(job):
    printed = job[0][0]["printed"]
    assert printed.count(f"step breakdown: {STEPS} step(s) per rank") == 2, printed  # epochs 1 and 3, not 2
    assert printed.count("verdict: compute-bound") == 2 and "tensor cores" not in printed, printed
    assert "   1  " in printed  # a row per rank
    assert job[0][1]["printed"] == ""
