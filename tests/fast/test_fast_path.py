"""The measured fast path: it keeps what is faster, computes what eager computes, and says so."""

import copy
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.fast import allocator, fast_path
from loom.fast.nhwc_max_pool import NhwcMaxPool2d
from tests.helpers import SCRIPTS, job_env, loom_run


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
    line = (capsys.readouterr().out.splitlines() or [""])[-1] + "\n"  # the trial's
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
    assert line == (
        "loom: fast path channels_last, 2.00x eager (forward+backward on the example batch: eager 2000.0 ms, "
        "channels_last 1000.0 ms, tolerance 1.7e-05 (fp32, longest reduction 288))\n"
    )
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
    assert capsys.readouterr().out.splitlines()[-1].startswith("loom: fast path channels_last, 2.00x eager")
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


def train_at(fast_path_setting, net: nn.Module, capsys: pytest.CaptureFixture) -> tuple[dict[str, torch.Tensor], str]:
    strategy = loom.OneDeviceStrategy(device="cpu")
    model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), fast_path=fast_path_setting)
    step = strategy.train_step(model, F.cross_entropy, opt)
    for x, y in batches():
        step(x, y)
    return net.state_dict(), capsys.readouterr().err


@pytest.fixture
def kept_memory():
    """The allocator as glibc's own before the test (an earlier prepare may have set it), given back after."""
    allocator.release()
    yield
    allocator.release()


def test_the_default_applies_exactly_what_it_says_and_trains_bit_for_bit_as_plain_eager(capsys, kept_memory):
    off, said_off = train_at(False, poolnet(), capsys)
    net = poolnet()
    keys = list(net.state_dict())
    on, said = train_at(None, net, capsys)
    assert said_off == ""
    assert said == (
        "loom: fast path, exact (changes no number; prepare(fast_path=False) turns it off): reuse_memory (mallopt in this "
        "process, which loom's launcher did not start), pool_before_relu (ReLUs after the max-pools they precede, in 1 nn.Sequential), "
        "pool_nhwc (1 nn.MaxPool2d pool a contiguous batch by the channels_last kernel)\n"
    )
    assert allocator.kept() == allocator.BY_MALLOPT
    assert type(net) is fast_path.PoolBeforeReluSequential
    assert [type(m) for m in net] == [nn.Conv2d, nn.ReLU, NhwcMaxPool2d, nn.Flatten, nn.Linear]  # in place, nothing else changed
    assert all(p.is_contiguous() for p in net.parameters())  # no channels_last, nor its edges
    assert fast_path._batch_channels_last not in net._forward_pre_hooks.values()
    assert list(on) == keys
    for key, value in off.items():  # nothing inexact: eager's parameters, bit for bit
        assert torch.equal(on[key], value), key
    x = batches(1)[0][0]
    assert torch.equal(net[:2](x), F.relu(net[0](x)))  # a slice is the model's own layers
    _, said = train_at(False, poolnet(), capsys)
    assert said.startswith("loom: fast path off (fast_path=False): glibc's malloc hands freed memory back again")
    assert allocator.kept() is None


def test_the_launcher_sets_the_allocator_before_its_processes_start_and_fast_path_false_undoes_it():
    """A block over 32 MiB made again and again faults its pages afresh each time unless memory is kept."""
    # Separate processes: once released, glibc may serve a block from a chunk the kept heap left free.
    launched = loom_run(["run", "--nproc", "1", str(SCRIPTS / "fast_defaults.py"), "default"], timeout=240)
    assert launched.returncode == 0, launched.stderr
    said = [line for line in launched.stderr.splitlines() if line.startswith("loom: fast path")]
    assert len(said) == 1 and said[0].endswith("reuse_memory (glibc tunables set by loom's launcher)"), launched.stderr
    (on,) = (int(line.split()[1]) for line in launched.stdout.splitlines() if line.startswith("faults"))
    assert on < 1_000, launched.stdout
    released = loom_run(["run", "--nproc", "1", str(SCRIPTS / "fast_defaults.py"), "off", "default"], timeout=240)
    assert released.returncode == 0, released.stderr
    said = [line for line in released.stderr.splitlines() if line.startswith("loom: fast path")]
    assert said[0].startswith("loom: fast path off (fast_path=False)"), said
    assert said[1].endswith("reuse_memory (mallopt in this process, its launcher's setting having been released)"), said
    off, again = (int(line.split()[1]) for line in released.stdout.splitlines() if line.startswith("faults"))
    assert off > 10_000 > 1_000 > again, released.stdout
    import subprocess
    import sys

    plain = subprocess.run([sys.executable, str(SCRIPTS / "fast_defaults.py"), "off", "default"], capture_output=True, text=True, timeout=240, env=job_env())
    assert plain.stderr.splitlines()[-1].endswith("reuse_memory (mallopt in this process, which loom's launcher did not start)"), plain.stderr
    off, on = (int(line.split()[1]) for line in plain.stdout.splitlines())
    assert off > 10_000 > 1_000 > on, plain.stdout


def test_a_process_that_sets_its_allocator_keeps_it_and_the_line_says_so(monkeypatch, capsys):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setattr(allocator._State, "how", None)
    _, said = train_at(None, convnet(), capsys)
    assert said.endswith("not reuse_memory (the process sets its allocator already (MALLOC_ARENA_MAX), which loom leaves as it is)\n")
    assert allocator.kept() is None
    assert allocator.launcher_environment({"MALLOC_ARENA_MAX": "2"}) == {}
    assert allocator.launcher_environment({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}) == {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2:" + allocator.TUNABLES}


def test_max_pool_then_relu_gives_relus_outputs_and_gradients_where_windows_tie_or_are_not_positive():
    x = torch.tensor([[-1.0, -2.0, 3.0, 3.0, 0.0, -0.5, 2.0, float("nan")], [-3.0, -4.0, 1.0, 3.0, 0.0, -1.0, 5.0, 1.0]]).view(1, 1, 2, 8)
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    outs = []
    for rewritten in (False, True):  # eager's ReLU then max-pool, and the fast path's container
        net = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))
        fast_path.pool_before_relu(net, rewritten)
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
    assert fast_path.pool_before_relu(net, True) == 0 and type(net) is nn.Sequential
    handle.remove()
    assert fast_path.pool_before_relu(net, True) == 1
    seen = []
    net[1].register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    x = batches(1)[0][0]
    net(x)
    assert seen == [net[0](x).shape]  # the ReLU's own input: the pair runs in its order once hooked


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_pool_before_relu_survives_shallow_copies_and_torchscript():
    net = poolnet()
    fast_path.pool_before_relu(net, True)
    x = batches(1)[0][0]
    want = net(x)
    replica = copy.copy(net)  # how DataParallel's replicas are made: the instance's own modules must run
    replica._modules = {**replica._modules, "4": nn.Linear(4 * 3 * 3, 3)}
    assert replica(x).shape == want.shape and not torch.equal(replica(x), want)
    assert torch.equal(torch.jit.script(net)(x), want)  # compiled as a plain nn.Sequential


def test_a_candidate_that_computes_differently_is_refused():
    assert fast_path._difference([torch.ones(3)], [torch.ones(3) * 1.001], tolerance=1e-4) == (
        "differs from eager by 1.0e-03 (relative) in its output, beyond the tolerance 1.0e-04, not kept"
    )
    assert fast_path._difference([torch.ones(3)], [torch.ones(3) * (1 + 1e-6)], tolerance=1e-4) is None


def test_bad_fast_path_options_get_one_line():
    strategy = loom.OneDeviceStrategy(device="cpu")
    with pytest.raises(ValueError, match=r"^prepare\(fast_path=...\) measures the model on a batch: pass example_input="):
        strategy.prepare(convnet(), fast_path=True)
    with pytest.raises(ValueError, match=r"^fast_path takes True, False or a list of candidates from channels_last, pool_before_relu, pool_nhwc, pool_kernel, compile, reuse_memory; got 'fast'$"):
        strategy.prepare(convnet(), fast_path="fast", example_input=torch.randn(2, 3, 6, 6))


def test_the_tolerance_admits_fp32_reassociation_and_nothing_more():
    """A sum of n fp32 terms taken in another order lands within it; a change of a part in a
    thousand does not. W2's weight gradients sum over 256 x 32 x 32 positions: channels_last's
    2.4e-4 there is reassociation, within the derived 4.9e-4 (a fixed 1e-4 refused it)."""
    n = 256 * 32 * 32
    terms = torch.randn(n, generator=torch.Generator().manual_seed(0)).abs()
    forward, backward = terms.sum(), terms.flip(0).view(-1, 1024).sum(0).sum()
    tolerance = fast_path.tolerance_for(None, n)
    assert f"{tolerance:.1e}" == "4.9e-04" and 2.4e-4 < tolerance < 1e-3
    assert fast_path._difference([forward], [backward], tolerance) is None
    assert fast_path._difference([forward], [forward * (1 + 1e-3)], tolerance) is not None
    assert fast_path.tolerance_for(torch.bfloat16, n) > 30 * tolerance  # bf16's rounding, not fp32's sums


class LayoutBound(nn.Module):
    """A convolution whose forward waits ``seconds`` unless its input is in ``fast`` layout (channels_last
    or not): a model whose faster program is known, whatever the machine's load."""

    def __init__(self, seconds: float, fast_is_channels_last: bool, first_call: float = 0.0) -> None:
        super().__init__()
        self.conv, self.seconds, self.fast_is_channels_last, self.first_call = nn.Conv2d(3, 4, 3), seconds, fast_is_channels_last, first_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_last = not x.is_contiguous()
        if channels_last != self.fast_is_channels_last:
            time.sleep(self.seconds)
        elif self.first_call:  # a one-time cost (a compile, a cache) of the fast program
            time.sleep(self.first_call)
            self.first_call = 0.0
        return self.conv(x).flatten(1)


@pytest.mark.parametrize("fast_is_channels_last", [True, False])
def test_the_trial_picks_the_truly_faster_program_after_its_first_call_costs(fast_is_channels_last):
    model = LayoutBound(0.5, fast_is_channels_last, first_call=2.0)  # the first call of the fast one is the slowest of all
    plan = fast_path.choose(model, batches(1)[0][0], ["channels_last"], lambda: torch.autocast("cpu", enabled=False))
    assert plan.channels_last == fast_is_channels_last, plan.line()
    slow, fast = ("eager", "channels_last") if fast_is_channels_last else ("channels_last", "eager")
    assert plan.seconds[slow] - plan.seconds[fast] > 0.3, plan.line()  # the wait, not the first call's
    assert "tolerance" in plan.line() and math.isfinite(plan.seconds["eager"])


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
