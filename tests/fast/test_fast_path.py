"""The measured fast path: it keeps what is faster, computes what eager computes, and says so."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.fast import fast_path


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def train(fast: bool, capsys: pytest.CaptureFixture) -> tuple[nn.Module, str, dict[str, torch.Tensor]]:
    strategy = loom.OneDeviceStrategy(device="cpu")
    data = batches()
    options = {"fast_path": ["channels_last"], "example_input": data[0][0]} if fast else {}
    raw = convnet()
    model, opt = strategy.prepare(raw, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), **options)
    after_prepare = {k: v.clone() for k, v in raw.state_dict().items()}
    line = capsys.readouterr().out
    step = strategy.train_step(model, F.cross_entropy, opt)
    for x, y in data:
        step(x, y)
    return raw, line, after_prepare


def test_channels_last_when_faster_trains_as_eager_does(monkeypatch, capsys):
    def timed(run, example, autocast):  # channels_last twice as fast as eager: kept
        weight = next(run.parameters())
        return 1.0 if weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous() else 2.0

    monkeypatch.setattr(fast_path, "_timed", timed)
    fast, line, untouched = train(True, capsys)
    eager, _, initial = train(False, capsys)
    assert line == "loom: fast path channels_last, 2.00x eager (forward+backward on the example batch: eager 2000.0 ms, channels_last 1000.0 ms)\n"
    assert fast[0].weight.is_contiguous(memory_format=torch.channels_last)
    for key, value in initial.items():  # the trial left parameters and BatchNorm statistics as they were
        assert torch.equal(untouched[key], value), key
    for key, value in eager.state_dict().items():
        assert torch.allclose(fast.state_dict()[key], value, rtol=1e-5, atol=1e-6), key


def test_channels_last_edges_take_the_batch_once_and_give_flattens_gradient_back_channels_last(monkeypatch, capsys):
    monkeypatch.setattr(fast_path, "_timed", lambda run, example, autocast: 1.0 if next(run.parameters()).is_contiguous() else 0.5)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3))
    x = batches(1)[0][0]
    model = loom.OneDeviceStrategy(device="cpu").prepare(net, fast_path=["channels_last"], example_input=x)
    assert capsys.readouterr().out.startswith("loom: fast path channels_last, 2.00x eager")
    seen = {}
    net[0].register_forward_hook(lambda m, args, out: seen.update(batch=args[0]))
    net[1].register_full_backward_hook(lambda m, grad_in, grad_out: seen.update(grad=grad_out[0]))
    model(x).sum().backward()
    assert not x.is_contiguous(memory_format=torch.channels_last)
    for tensor in (seen["batch"], seen["grad"]):
        assert tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()


def test_a_candidate_that_is_not_faster_or_fails_is_not_kept_and_the_line_says_why(monkeypatch):
    monkeypatch.setattr(fast_path, "_timed", lambda run, example, autocast: 1.0)
    net = convnet()
    plan = fast_path.choose(net, batches(1)[0][0], ["channels_last"], lambda: torch.autocast("cpu", enabled=False))
    assert plan.name == "eager" and plan.rejected == {"channels_last": "1.00x eager, not kept"}
    assert not any(m._forward_pre_hooks for m in net.modules())  # the trial's hooks are gone

    class Viewing(nn.Module):  # .view of an activation, which channels_last cannot take
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.linear = nn.Conv2d(3, 2, 3), nn.Linear(2 * 4 * 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(self.conv(x).view(len(x), -1))

    plan = fast_path.choose(Viewing(), batches(1)[0][0], ["channels_last"], lambda: torch.autocast("cpu", enabled=False))
    assert plan.rejected["channels_last"].startswith("fails on the example batch (RuntimeError: view size is not compatible")
    mlp = fast_path.choose(nn.Linear(4, 2), torch.randn(3, 4), ["channels_last"], lambda: torch.autocast("cpu", enabled=False))
    assert mlp.line().endswith("; channels_last: no 2-D convolution")


def poolnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3))


def test_pool_before_relu_when_faster_trains_as_eager_does_and_leaves_the_state_dict_as_it_was(monkeypatch, capsys):
    monkeypatch.setattr(fast_path, "_timed", lambda run, example, autocast: 0.8 if type(run) is not nn.Sequential else 1.0)
    data = batches()
    trained, nets = {}, {}
    for fast in (True, False):
        net = nets[fast] = poolnet()
        keys = list(net.state_dict())
        options = {"fast_path": ["pool_before_relu"], "example_input": data[0][0]} if fast else {}
        strategy = loom.OneDeviceStrategy(device="cpu")
        model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), **options)
        step = strategy.train_step(model, F.cross_entropy, opt)
        for x, y in data:
            step(x, y)
        trained[fast] = net.state_dict()
        assert list(trained[fast]) == keys
    assert capsys.readouterr().out.startswith("loom: fast path pool_before_relu, 1.25x eager")
    assert type(nets[True]) is fast_path.PoolBeforeReluSequential and type(nets[False]) is nn.Sequential
    assert [type(m) for m in nets[True]] == [nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.Flatten, nn.Linear]  # in place
    x = data[0][0]
    assert torch.equal(nets[True][:2](x), F.relu(nets[True][0](x)))  # a slice is the model's own layers
    for key, value in trained[False].items():
        assert torch.equal(trained[True][key], value), key


def test_max_pool_then_relu_gives_relus_outputs_and_gradients_where_windows_tie_or_are_not_positive():
    x = torch.tensor([[-1.0, -2.0, 3.0, 3.0, 0.0, -0.5, 2.0, float("nan")], [-3.0, -4.0, 1.0, 3.0, 0.0, -1.0, 5.0, 1.0]]).view(1, 1, 2, 8)
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    outs = []
    for rewritten in (False, True):  # eager's ReLU then max-pool, and the fast path's container
        net = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))
        fast_path.apply(net, fast_path.FastPath(pool_before_relu=rewritten))
        assert (type(net) is fast_path.PoolBeforeReluSequential) == rewritten
        leaf = x.clone().requires_grad_()
        out = net(leaf)
        out.backward(grad)
        outs.append((out.detach(), leaf.grad))
    assert torch.equal(outs[0][0].nan_to_num(), outs[1][0].nan_to_num()) and outs[0][0].isnan().equal(outs[1][0].isnan())
    assert torch.equal(outs[0][1], outs[1][1])


def test_pool_before_relu_leaves_hooked_modules_alone_even_when_hooked_after_prepare(monkeypatch):
    net = poolnet()
    handle = net[1].register_forward_hook(lambda m, args, out: None)
    plan = fast_path.choose(net, batches(1)[0][0], ["pool_before_relu"], lambda: torch.autocast("cpu", enabled=False))
    assert plan.rejected == {"pool_before_relu": "no nn.ReLU followed by an nn.MaxPool2d in an nn.Sequential (without hooks)"}
    handle.remove()
    fast_path.apply(net, fast_path.FastPath(pool_before_relu=True))
    seen = []
    net[1].register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    x = batches(1)[0][0]
    net(x)
    assert seen == [net[0](x).shape]  # the ReLU's own input: the pair runs in its order once hooked


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_pool_before_relu_survives_shallow_copies_and_torchscript():
    net = poolnet()
    fast_path.apply(net, fast_path.FastPath(pool_before_relu=True))
    x = batches(1)[0][0]
    want = net(x)
    replica = copy.copy(net)  # how DataParallel's replicas are made: the instance's own modules must run
    replica._modules = {**replica._modules, "4": nn.Linear(4 * 3 * 3, 3)}
    assert replica(x).shape == want.shape and not torch.equal(replica(x), want)
    assert torch.equal(torch.jit.script(net)(x), want)  # compiled as a plain nn.Sequential


def _one_rank_hooks_the_relu() -> tuple[dict[str, str], list[str]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    net = poolnet()
    if dist.get_rank() == 0:  # activations logged on the chief only
        net[1].register_forward_hook(lambda m, args, out: None)
    plan = fast_path.choose(net, batches(1)[0][0], ["pool_before_relu"], lambda: torch.autocast("cpu", enabled=False))
    dist.destroy_process_group()
    return plan.rejected, sorted(plan.seconds)


def test_replicas_whose_hooks_differ_try_the_same_programs_and_agree():
    from tests.helpers import run_ranks

    (rejected0, timed0), (rejected1, timed1) = run_ranks(_one_rank_hooks_the_relu, 2, timeout=60)
    assert timed0 == timed1 == ["eager"]
    assert rejected0["pool_before_relu"].startswith("no nn.ReLU followed by an nn.MaxPool2d")
    assert rejected1["pool_before_relu"] == "computes differently on another replica, not kept"


def test_a_candidate_that_computes_differently_is_refused():
    assert fast_path._difference([torch.ones(3)], [torch.ones(3) * 1.001], tolerance=1e-4) == "differs from eager by 1.0e-03 (relative) in its output, not kept"
    assert fast_path._difference([torch.ones(3)], [torch.ones(3) * (1 + 1e-6)], tolerance=1e-4) is None


def test_bad_fast_path_options_get_one_line():
    strategy = loom.OneDeviceStrategy(device="cpu")
    with pytest.raises(ValueError, match=r"^prepare\(fast_path=...\) measures the model on a batch: pass example_input="):
        strategy.prepare(convnet(), fast_path=True)
    with pytest.raises(ValueError, match=r"^fast_path takes True, False or a list of candidates from channels_last, pool_before_relu, pool_kernel, compile, reuse_memory; got 'fast'$"):
        strategy.prepare(convnet(), fast_path="fast", example_input=torch.randn(2, 3, 6, 6))


@pytest.fixture
def allocator():
    """The process's allocator is set back after a test that lets the trial set it."""
    yield
    if fast_path._reusing:
        fast_path.reuse_memory(False)


def _faults_of_a_64mib_block_made_again() -> int:
    import resource

    for _ in range(3):  # 64 MiB, above glibc's mmap threshold: unmapped at free unless memory is kept
        torch.ones(16 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_reuse_memory_pairs_with_channels_last_only_when_the_pair_is_faster_and_then_keeps_freed_memory(monkeypatch, capsys, allocator):
    def timed(run, example, autocast):  # reuse_memory 1.25x, channels_last 2x, both 2.5x
        weight = next(run.parameters())
        return (1.0 if weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous() else 2.0) / (2.0 if fast_path._reusing else 1.6)

    monkeypatch.setattr(fast_path, "_timed", timed)
    assert _faults_of_a_64mib_block_made_again() > 10_000  # 16,384 pages of 4 KiB
    strategy = loom.OneDeviceStrategy(device="cpu")
    model = strategy.prepare(convnet(), fast_path=["channels_last", "reuse_memory"], example_input=batches(1)[0][0])
    assert capsys.readouterr().out == (
        "loom: fast path channels_last+reuse_memory, 2.50x eager (forward+backward on the example batch: eager 1250.0 ms, "
        "channels_last 625.0 ms, reuse_memory 1000.0 ms, channels_last+reuse_memory 500.0 ms)\n"
    )
    assert loom.unwrap(model)[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert fast_path._reusing and _faults_of_a_64mib_block_made_again() < 1_000
    again = fast_path.choose(convnet(), batches(1)[0][0], ["reuse_memory"], lambda: torch.autocast("cpu", enabled=False))
    assert again.rejected == {"reuse_memory": "this process reuses memory already (an earlier prepare chose it)"} and fast_path._reusing
    fast_path.reuse_memory(False)  # the next trial starts from a process that does not keep memory
    monkeypatch.setattr(fast_path, "_timed", lambda run, example, autocast: 1.0 / (1.04 if fast_path._reusing else 1.0))
    plan = fast_path.choose(convnet(), batches(1)[0][0], ["reuse_memory"], lambda: torch.autocast("cpu", enabled=False))
    assert plan.name == "eager" and plan.rejected == {"reuse_memory": "1.04x eager, not kept"}
    assert not fast_path._reusing and _faults_of_a_64mib_block_made_again() > 10_000  # the trial set the allocator back


def test_reuse_memory_is_kept_for_the_page_faults_it_ends_when_it_is_not_slower(monkeypatch, allocator):
    faults = [0]

    def timed(run, example, autocast):  # as fast either way; 5,000 page faults a pass unless memory is kept
        faults[0] += 0 if fast_path._reusing else 5_000
        return 1.0 if fast_path._reusing else 0.99

    monkeypatch.setattr(fast_path, "_timed", timed)
    monkeypatch.setattr(fast_path, "_minor_faults", lambda: faults[0])
    plan = fast_path.choose(convnet(), batches(1)[0][0], ["reuse_memory"], lambda: torch.autocast("cpu", enabled=False))
    assert plan.name == "reuse_memory"
    assert plan.line().endswith("; reuse_memory kept for its page faults (5,000 a pass without it, 0 with)")
    fast_path.reuse_memory(False)
    monkeypatch.setattr(fast_path, "_timed", lambda run, example, autocast: timed(run, example, autocast) * (1.2 if fast_path._reusing else 1.0))
    slower = fast_path.choose(convnet(), batches(1)[0][0], ["reuse_memory"], lambda: torch.autocast("cpu", enabled=False))
    assert slower.name == "eager" and slower.rejected == {"reuse_memory": "0.83x eager, not kept"}


def test_reuse_memory_is_refused_where_the_process_sets_its_allocator(monkeypatch, allocator):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    plan = fast_path.choose(convnet(), batches(1)[0][0], ["channels_last", "reuse_memory"], lambda: torch.autocast("cpu", enabled=False))
    assert plan.rejected["reuse_memory"] == "the process sets its allocator already (MALLOC_ARENA_MAX), which it would override"
    assert sorted(plan.seconds) == ["channels_last", "eager"] and not fast_path._reusing
    with pytest.raises(RuntimeError, match=r"^reuse_memory cannot be set here: the process sets its allocator already \(MALLOC_ARENA_MAX\)"):
        fast_path.reuse_memory(True)


def _one_rank_refuses_channels_last() -> tuple[dict[str, str], list[str]]:
    import contextlib

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:  # as if this replica's kernels computed differently
        fast_path._difference = lambda reference, got, tolerance: "differs here"
    plan = fast_path.choose(convnet(), batches(1)[0][0], ["channels_last"], contextlib.nullcontext)
    dist.destroy_process_group()
    return plan.rejected, sorted(plan.seconds)


def test_a_candidate_refused_on_one_replica_is_dropped_on_every_replica():
    """Each replica checks candidates on its own; the timings they agree on must have one shape."""
    from tests.helpers import run_ranks

    (rejected0, timed0), (rejected1, timed1) = run_ranks(_one_rank_refuses_channels_last, 2, timeout=60)
    assert timed0 == timed1 == ["eager"]
    assert rejected0["channels_last"] == "computes differently on another replica, not kept"
    assert rejected1["channels_last"] == "differs here"
