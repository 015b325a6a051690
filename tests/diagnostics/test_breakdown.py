"""The step recorder, in one process: each part of a step lands where it belongs, in every loop."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.diagnostics.breakdown import StepRecorder
from loom.diagnostics.verdict import JobFacts, RankTimes, decide

WAIT = 0.1  # each slow part; far above what a loaded machine adds to the rest (tens of ms were seen)


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(WAIT)
        return self.layer(x)


class SlowOptimizer(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(WAIT)
        return super().step(closure)


def _slow_batches(n: int = 5):
    for _ in range(n):
        time.sleep(WAIT)
        yield torch.randn(8, 4), torch.randint(0, 2, (8,))


def _check(report, steps: int) -> None:
    rank = report.ranks[0]
    assert rank.steps == steps and rank.samples == 8 * steps, report.table()
    assert rank.seconds["input"] >= WAIT and rank.seconds["compute"] >= WAIT and rank.seconds["optimizer"] >= WAIT, report.table()
    assert rank.seconds["comm"] < WAIT / 2 and rank.seconds["other"] < WAIT / 2, report.table()  # a loaded machine may add a few ms
    assert abs(sum(rank.seconds[p] for p in ("input", "compute", "comm", "optimizer", "other")) - rank.total) < 1e-9


def test_eager_loop_is_recorded():
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(Slow(), lambda p: SlowOptimizer(p, lr=0.1))
    for x, y in _slow_batches():
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(torch.randn(8, 4))  # evaluation is not a step
    _check(strategy.report(show=False), steps=4)  # the first step is start-up


def test_train_step_is_recorded_with_accumulation():
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(Slow(), lambda p: SlowOptimizer(p, lr=0.1))
    step = strategy.train_step(model, F.cross_entropy, opt, accumulate=2)
    for x, y in _slow_batches():
        step(x, y)
    report = strategy.report(show=False)
    _check(report, steps=4)
    assert report.ranks[0].seconds["compute"] >= 2 * WAIT  # two micro-batches per step


def test_fit_is_recorded_and_its_bookkeeping_is_not_input(capsys):
    strategy = loom.OneDeviceStrategy()
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))

    bookkeeping = 2 * WAIT  # far above what a loaded machine adds to reading a batch (39 ms was seen)

    class SlowCallback(loom.Callback):
        def on_batch_end(self, state, loss):
            time.sleep(bookkeeping)

    loom.fit(Slow(), F.cross_entropy, lambda p: SlowOptimizer(p, lr=0.1), data, batch_size=8, strategy=strategy, callbacks=[SlowCallback()])
    printed = capsys.readouterr().out
    assert "step breakdown: 5 step(s) per rank" in printed and "verdict: " in printed, printed
    row = printed.splitlines()[printed.splitlines().index(next(l for l in printed.splitlines() if l.startswith("rank"))) + 1]
    input_ms, compute_ms, comm_ms, optimizer_ms, other_ms = map(float, row.split()[2:7])
    assert input_ms < bookkeeping * 1e3 / 2 and other_ms >= bookkeeping * 1e3 and compute_ms >= WAIT * 1e3 and optimizer_ms >= WAIT * 1e3, printed


def test_reset_starts_a_window_and_skips_its_first_step():
    recorder = StepRecorder()
    for _ in range(3):
        recorder.forward_begins(4)
        recorder.backward_done()
        recorder.step_done()
    assert recorder.steps == 2 and recorder.samples == 8
    recorder.reset()
    recorder.forward_begins(4)
    recorder.backward_done()
    recorder.step_done()
    assert recorder.steps == 0 and recorder.means()["total"] == 0.0


def _rank(rank: int, input=0.0, compute=0.0, comm=0.0, optimizer=0.001, other=0.001) -> RankTimes:
    seconds = {"input": input, "compute": compute, "comm": comm, "optimizer": optimizer, "other": other}
    seconds["total"] = sum(seconds.values())
    return RankTimes(rank, f"host{rank}", seconds, steps=10, samples=80)


@pytest.mark.parametrize(
    "ranks, kind",
    [
        ([_rank(0, compute=0.05, comm=0.002), _rank(1, compute=0.05, comm=0.003)], "compute-bound"),
        ([_rank(0, compute=0.01, input=0.02), _rank(1, compute=0.01, input=0.02)], "input-bound"),
        ([_rank(0, compute=0.01, comm=0.03), _rank(1, compute=0.01, comm=0.03)], "communication-bound"),
        ([_rank(i, compute=0.01, comm=0.04 if i != 2 else 0.0) for i in range(3)] + [_rank(3, compute=0.01, comm=0.04)], "communication-bound"),
        ([_rank(0, compute=0.01, comm=0.03), _rank(1, compute=0.04), _rank(2, compute=0.01, comm=0.03)], "straggler-bound"),
        ([_rank(0, compute=0.01, input=0.005, comm=0.006, other=0.01)], "balanced"),
        ([], "no steps"),
    ],
)
def test_decide(ranks, kind):
    verdict = decide(ranks, JobFacts(grad_bytes=4_000_000, bandwidth=1e9, bucket_cap_mb=25.0))
    assert verdict.kind == kind, verdict.message
    if kind == "straggler-bound":
        assert verdict.rank == 1 and "rank 1 (host host1)" in verdict.message and "30.0 ms (+250%)" in verdict.message
        assert "(predicted gain 30.0 ms, 71% of the step)" in verdict.message
    if kind == "communication-bound":
        assert "4.0 MB per step: 4.0 ms" in verdict.message and "compression=" not in verdict.message  # 2 ms of a 42 ms step


def _two(**parts) -> list[RankTimes]:
    return [_rank(0, **parts), _rank(1, **parts)]


def test_compute_bound_advises_bf16_only_where_the_device_runs_it_faster_with_the_gain_beside_it():
    ranks = _two(compute=0.05)  # a 52 ms step
    amx = decide(ranks, JobFacts(bf16_units=True)).message
    assert "precision='bf16-mixed' runs forward and backward in bfloat16 on this CPU's bf16 matrix units" in amx
    assert "(predicted gain 25.0 ms, 48% of the step)" in amx and "tensor cores" not in amx
    plain_cpu = decide(ranks, JobFacts(bf16_units=False)).message
    assert "bf16" not in plain_cpu.split("step. ")[1].split(":")[0] and plain_cpu.endswith(
        "No fix is predicted to save 10% of the step: this CPU has no bf16 matrix units, so bf16-mixed would not be faster"
    )
    assert "on tensor cores (predicted gain 25.0 ms" in decide(ranks, JobFacts(device="cuda")).message
    assert decide(ranks, JobFacts(precision="bf16-mixed", bf16_units=True)).message.endswith("No fix is predicted to save 10% of the step")


def test_bandwidth_bound_advises_compression_and_a_larger_batch_with_their_gains():
    verdict = decide(_two(compute=0.01, comm=0.045), JobFacts(grad_bytes=40_000_000, bandwidth=1e9, latency=1e-4, bucket_cap_mb=25.0))
    assert verdict.kind == "communication-bound"
    assert "40.0 MB per step: 40.0 ms" in verdict.message
    assert "compression='bf16' halves the bytes (predicted gain 20.0 ms, 35% of the step)" in verdict.message
    assert "accumulate=4) all-reduces once per 4x the samples (per today's batch) (predicted gain 30.1 ms" in verdict.message
    assert "bucket_cap_mb" not in verdict.message  # 2 buckets: one round trip more is no gain


def test_latency_bound_advises_larger_buckets_not_compression():
    facts = JobFacts(grad_bytes=20_000_000, bandwidth=1e10, latency=1e-3, bucket_cap_mb=0.5)  # 39 buckets, 2 ms of bytes
    verdict = decide(_two(compute=0.01, comm=0.042), facts)
    assert verdict.kind == "communication-bound"
    assert "39 buckets cost 38.0 ms more in round trips of 1.0 ms" in verdict.message
    assert "bucket_cap_mb=25 (now 0.5) sends 1 bucket(s), not 39 (predicted gain 38.0 ms, 70% of the step)" in verdict.message
    assert "compression" not in verdict.message  # 1 ms: under a tenth of the step


def test_a_wait_for_a_slower_peer_gets_no_fix_that_cannot_pay():
    """605 KB all-reduced in 1 ms of a 6 ms wait, the rest the slower peer: bf16 could save 0.5 ms of 20."""
    verdict = decide(_two(compute=0.012, comm=0.006), JobFacts(grad_bytes=605_000, bandwidth=6.05e8, latency=2e-4, bucket_cap_mb=25.0))
    assert verdict.kind == "communication-bound"
    assert "the other 5.0 ms is waiting for a slower peer or the comm hook" in verdict.message
    assert verdict.message.endswith("No fix is predicted to save 10% of the step: the wait is mostly not the transfer")


def test_the_verdict_holds_across_epochs_whose_numbers_move_within_noise():
    epochs = [_two(compute=0.022, comm=c, other=0.006) for c in (0.011, 0.0085, 0.010, 0.008, 0.0105)]  # comm 27%, 22%, ...
    alone = [decide(ranks, JobFacts()).kind for ranks in epochs]
    assert len(set(alone)) == 2  # without the previous verdict it flips with the noise
    kinds, previous = [], None
    for ranks in epochs:
        previous = decide(ranks, JobFacts(), previous).kind
        kinds.append(previous)
    assert kinds == ["communication-bound"] * 5
    assert decide(_two(compute=0.022, comm=0.002), JobFacts(), "communication-bound").kind == "compute-bound"  # a real change moves it
