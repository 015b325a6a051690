"""DDP's options through MirroredStrategy, in one 2-rank job shared by the assertions."""

import contextlib
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import loom
from tests.helpers import collected, run_ranks

pytestmark = pytest.mark.xdist_group("data_parallel_options")  # its tests share one launched job: one test process runs them all


def _with_unused_head() -> nn.Module:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 2)
            self.head = nn.Linear(2, 2)  # never used in forward

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    return Net()


def _with_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _batches(strategy, steps=3, batch=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch, 4, generator=g) * 3 + 1
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 1).long())
    return strategy.distribute(data, batch_size=batch, shuffle=False)


def _train_batchnorm(strategy, accumulate=1):
    model, opt = strategy.prepare(_with_batchnorm(), lambda p: torch.optim.SGD(p, lr=0.1))
    step = strategy.train_step(model, F.cross_entropy, opt, accumulate=accumulate)
    for x, y in _batches(strategy):
        step(x, y)
    return {k: v.detach().clone() for k, v in loom.unwrap(model).state_dict().items()}


def _resumed_batchnorm(strategy, directory):
    """Two steps, save, two more; against a fresh model restored from the save, then two steps."""
    batches = list(_batches(strategy, steps=4))
    runs = []
    for resumed in (False, True):
        model, opt = strategy.prepare(_with_batchnorm(), lambda p: torch.optim.SGD(p, lr=0.1))
        step = strategy.train_step(model, F.cross_entropy, opt)
        if resumed:
            strategy.restore(directory, model=model, optimizer=opt)
        for x, y in batches[:2] if not resumed else []:
            step(x, y)
        if not resumed:
            strategy.save(directory, step=2, model=model, optimizer=opt)
        for x, y in batches[2:]:
            step(x, y)
        runs.append({k: v.detach().clone() for k, v in loom.unwrap(model).state_dict().items()})
    return runs


def _saved_beside_another(strategy, directory):
    """Process 0 still holds a prepared model the others dropped (their garbage collector ran, its
    did not): a save of another model sends that model's buffers only, in every process alike."""
    kept = [strategy.prepare(_with_batchnorm())]
    gone = weakref.ref(kept[0])
    if strategy.replica_id != 0:
        kept.clear()
        assert collected(gone), "the dropped model was not freed"
    model, opt = strategy.prepare(_with_batchnorm(), lambda p: torch.optim.SGD(p, lr=0.1))
    strategy.train_step(model, F.cross_entropy, opt)(*next(iter(_batches(strategy))))
    saved = strategy.save(directory / "beside", step=1, model=model, optimizer=opt)
    del kept
    return saved is not None


def _job(directory):
    found = {}
    strategy = loom.MirroredStrategy(timeout=120)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        strategy.print("once per job")
    found["printed"] = printed.getvalue()

    model, opt = strategy.prepare(_with_unused_head(), lambda p: torch.optim.SGD(p, lr=0.1))
    try:
        for x, y in _batches(strategy):
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    except RuntimeError as error:
        found["unused_error"] = str(error)
    tolerant = loom.MirroredStrategy(timeout=120, find_unused_parameters=True)
    model, opt = tolerant.prepare(_with_unused_head(), lambda p: torch.optim.SGD(p, lr=0.1))
    step = tolerant.train_step(model, F.cross_entropy, opt)
    found["unused_steps"] = sum(1 for x, y in _batches(tolerant) if step(x, y) is not None)

    try:  # what torch's own recipe gives: SyncBatchNorm layers, which run on GPUs only
        strategy.prepare(nn.SyncBatchNorm.convert_sync_batchnorm(_with_batchnorm()))
    except ValueError as error:
        found["torch_sync_batchnorm"] = str(error)
    found["sync_batchnorm"] = _train_batchnorm(loom.MirroredStrategy(timeout=120, sync_batchnorm=True))
    found["sync_batchnorm_fp16"] = _train_batchnorm(loom.MirroredStrategy(timeout=120, sync_batchnorm=True, precision="16-mixed"))
    found["static_graph_accumulated"] = _train_batchnorm(loom.MirroredStrategy(timeout=120, static_graph=True), accumulate=2)
    found["accumulated"] = _train_batchnorm(strategy, accumulate=2)
    found["batchnorm_resumed"] = _resumed_batchnorm(strategy, directory)
    found["saved_beside_another"] = _saved_beside_another(strategy, directory)

    model, opt = strategy.prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    calls = []

    def counting_all_reduce(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_all_reduce)  # fp32: the prepared model is the DDP wrapper
    with strategy.accumulate(4):
        for x, y in _batches(strategy, steps=8, batch=4):
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    found["all_reduces"] = len(calls)
    strategy.shutdown()
    return found


@pytest.fixture(scope="session")
def job(tmp_path_factory):
    return run_ranks(_job, 2, tmp_path_factory.mktemp("ddp"), timeout=150)


def test_print_prints_on_the_chief_only(job):
    assert [rank["printed"] for rank in job] == ["once per job\n", ""]


def test_an_unused_parameter_is_named_with_the_option_to_set(job):
    for rank in job:
        assert rank["unused_error"].startswith("parameter(s) head.weight, head.bias got no gradient in the previous step")
        assert "pass find_unused_parameters=True to the strategy" in rank["unused_error"]
        assert rank["unused_steps"] == 3


def test_sync_batchnorm_uses_the_global_batch_statistics(job):
    """Two replicas with synchronised BatchNorm equal one replica on the global batch, running statistics too."""
    reference = _train_batchnorm(loom.OneDeviceStrategy())
    for rank in job:
        for key, value in reference.items():
            torch.testing.assert_close(rank["sync_batchnorm"][key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert (reference["1.running_mean"] - torch.zeros(8)).abs().max() > 0.1  # the statistics moved


def test_torchs_sync_batchnorm_on_cpu_is_refused_with_the_option_that_syncs_there(job):
    for rank in job:  # it was DDP's "SyncBatchNorm layers only work with GPU modules"
        assert rank["torch_sync_batchnorm"] == (
            "MirroredStrategy cannot run torch's SyncBatchNorm on CPU (layer '1'; torch's runs on GPUs only): keep the model's "
            "BatchNorm layers (no convert_sync_batchnorm) and pass MirroredStrategy(sync_batchnorm=True), which syncs them over gloo"
        )


def test_accumulation_all_reduces_once_per_update(job):
    """accumulate(4) over 8 micro-batches: 2 updates, so 2 all-reduces of the one bucket (not 8)."""
    assert [rank["all_reduces"] for rank in job] == [2, 2]


def test_sync_batchnorm_keeps_fp32_statistics_under_fp16(job):
    """Under autocast fp16 the sums overflowed (81,920 > 65,504): statistics are kept in fp32."""
    for rank in job:
        fp16, fp32 = rank["sync_batchnorm_fp16"], rank["sync_batchnorm"]
        for key, value in fp32.items():
            assert torch.isfinite(fp16[key].float()).all(), key
            torch.testing.assert_close(fp16[key].float(), value.float(), rtol=0.05, atol=0.05, msg=key)


def test_static_graph_with_accumulation_equals_plain_accumulation(job):
    """DDP's static graph is recorded in a synchronised backward; the first micro-batch is not skipped."""
    for rank in job:
        for key, value in rank["accumulated"].items():
            torch.testing.assert_close(rank["static_graph_accumulated"][key], value, rtol=1e-6, atol=1e-6, msg=key)


def test_a_save_syncs_the_buffers_of_the_models_it_saves_not_of_every_model_still_alive(job):
    assert [rank["saved_beside_another"] for rank in job] == [True, True]


def test_a_batchnorm_model_resumes_exactly(job):
    """Replica 0's BatchNorm statistics, which DDP hands every replica, are the ones saved."""
    for rank in job:
        straight, resumed = rank["batchnorm_resumed"]
        for key, value in straight.items():
            assert torch.equal(resumed[key], value), key
