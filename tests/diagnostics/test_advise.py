"""loom.advise on models built for each answer; the reasons quote the numbers they rest on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loom
from loom.diagnostics.advise import recommend
from loom.diagnostics import report
from loom.diagnostics.report import BreakdownReport, mention_advice
from loom.diagnostics.verdict import RankTimes, Verdict


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(1_000_000, 16, mode="sum")
        self.head = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids))


def _dense() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))


DENSE_BYTES = (256 * 512 + 512 + 512 * 256 + 256) * 4


def test_sparse_model_gets_parameter_servers():
    ids = torch.arange(64 * 8).reshape(64, 8)  # 512 distinct rows of 1,000,000
    advice = loom.advise(Sparse(), ids, replicas=4, nodes=2, link_gbps=10, compute_seconds=0.005)
    assert advice.recommendation == "ParameterServerStrategy", advice
    assert advice.facts.rows_touched == pytest.approx(512 / 1_000_000)
    assert "1,000,000 rows" in advice.reasons and "touches 0.051% of the rows" in advice.reasons
    assert "MultiWorkerMirroredStrategy moves 96.0 MB" in advice.reasons  # 2 (n-1)/n of 64 MB


def test_dense_model_on_a_fast_link_gets_mirrored_from_measured_compute():
    advice = loom.advise(_dense(), torch.randn(32, 256), replicas=4, link_gbps=400)
    assert advice.recommendation == "MirroredStrategy", advice
    assert advice.facts.parameter_bytes == DENSE_BYTES and advice.facts.compute_source == "measured"
    assert advice.facts.activation_bytes_per_sample == (256 + 512) * 4  # the input and ReLU's output, saved for backward
    assert "1.1 MB of parameters" in advice.reasons and "given link of 400.00 Gbit/s" in advice.reasons


def test_dense_model_on_a_slow_link_gets_compression():
    advice = loom.advise(_dense(), torch.randn(32, 256), replicas=4, nodes=2, link_gbps=0.1, compute_seconds=0.02)
    assert advice.recommendation == "MultiWorkerMirroredStrategy(compression='bf16')", advice
    assert "moving 788.7 KB per replica, where MultiWorkerMirroredStrategy moves 1.6 MB and would take" in advice.reasons


def test_model_four_times_a_device_gets_sharded_or_pipeline():
    state = DENSE_BYTES * 4  # parameters, gradients and two Adam slots
    advice = loom.advise(_dense(), torch.randn(32, 256), replicas=8, device_memory=state // 4, link_gbps=100, compute_seconds=0.02)
    assert advice.recommendation in ("ShardedStrategy", "PipelineStrategy"), advice
    assert not next(o for o in advice.options if o.strategy == "MirroredStrategy").fits
    assert "MirroredStrategy moves" in advice.reasons and "does not fit" in advice.reasons


def test_the_model_is_left_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loom.advise(model, torch.randn(8, 4), replicas=2, link_gbps=10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"advise\(\) needs replicas >= nodes >= 1, got replicas=1, nodes=2"):
        loom.advise(_dense(), torch.randn(2, 256), replicas=1, nodes=2)
    with pytest.raises(TypeError, match="advise\\(\\) needs a sample batch with a batch dimension"):
        loom.advise(_dense(), torch.tensor(1.0), replicas=2, compute_seconds=0.01)


class _SlowLinkStrategy:
    """Two replicas whose all-reduce runs at 1 MB/s: what mention_advice sees of a strategy."""

    num_replicas_in_sync, is_chief, device = 2, True, torch.device("cpu")

    def reduce(self, tensor, op):
        import time

        time.sleep(tensor.numel() * 4 / 1e6)
        return tensor


def test_end_of_run_mentions_a_recommendation_other_than_the_strategy_in_use(capsys, monkeypatch):
    monkeypatch.setattr(report, "PROBE_BYTES", 2**16)  # the link's rate, measured without seconds of sleep
    ranks = [RankTimes(r, "h", {"compute": 0.01, "total": 0.02}, steps=5, samples=40) for r in range(2)]
    result = BreakdownReport(ranks, Verdict("compute-bound", ""), None, 1000.0)
    mention_advice(_SlowLinkStrategy(), Sparse(), torch.arange(16).reshape(2, 8), result)
    printed = capsys.readouterr().out
    assert printed.startswith("advice: ParameterServerStrategy rather than _SlowLinkStrategy (predicted gain "), printed
    gain = float(printed.split("predicted gain ")[1].split(" ms")[0])
    assert 0.1 * 20.0 <= gain < 20.0 and "of the step). " in printed, printed  # a tenth of the 20 ms step at least
    assert "measured link of 0.01 Gbit/s" in printed and "compute time of 10.0 ms" in printed



def test_reasons_name_the_strategy_in_use_when_it_differs():
    facts = loom.advise(_dense(), torch.randn(8, 256), replicas=2, link_gbps=400, compute_seconds=0.01).facts
    assert "The job runs OneDeviceStrategy." in recommend(facts, current="OneDeviceStrategy").reasons
    assert "The job runs" not in recommend(facts, current="MirroredStrategy").reasons
