"""The fast path's pool_kernel: eager's max-pool, bit for bit, without its int64 indices."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.fast import fast_path, window_max_pool
from loom.fast.nhwc_max_pool import NhwcMaxPool2d
from loom.fast.window_max_pool import WindowMaxPool2d

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def crafted(dtype: torch.dtype, k: int) -> torch.Tensor:
    """A channels_last batch with ties, signed zeros, NaN and -inf windows."""
    flat = torch.randn(2 * 3 * 6 * k * 6 * k, generator=torch.Generator().manual_seed(0)).to(dtype)
    flat[::7], flat[::11], flat[::29], flat[::31] = 0.0, -0.0, float("nan"), float("-inf")
    ties = torch.arange(5, len(flat) - 1, 13)
    flat[ties] = flat[ties + 1]
    return flat.view(2, 3, 6 * k, 6 * k).contiguous(memory_format=torch.channels_last)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN payloads aside."""
    a, b = (t.contiguous(memory_format=torch.channels_last) for t in (a, b))
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0).view(BITS[a.dtype]), b.masked_fill(nan, 0).view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [2, 3])
def test_outputs_and_gradients_are_eagers_bit_for_bit(dtype, k):
    x = crafted(dtype, k)
    results = []
    for kernel in (False, True):
        pool = nn.MaxPool2d(k)
        window_max_pool.use([pool], kernel)
        leaf = x.clone().requires_grad_()
        out = pool(leaf)
        assert ("WindowMaxPool" in type(out.grad_fn).__name__) == kernel
        grad = (torch.arange(out.numel(), dtype=dtype).view_as(out) % 7).contiguous(memory_format=torch.channels_last)
        grad[..., 0] = -0.0  # eager adds into zeros: +0.0
        out.backward(grad)
        results.append((out, leaf.grad))
    (want, want_grad), (got, got_grad) = results
    assert same(got, want) and same(got_grad, want_grad)
    assert got.is_contiguous(memory_format=torch.channels_last) and got_grad.is_contiguous(memory_format=torch.channels_last)


def test_inputs_or_settings_it_does_not_suit_run_eagers_pool(monkeypatch):
    monkeypatch.setattr(window_max_pool.Kernels, "__call__", lambda self, name: pytest.fail("the kernels ran"))
    pool = nn.MaxPool2d(2)
    window_max_pool.use([pool], True)
    cl = crafted(torch.float32, 2).requires_grad_()
    for x in (cl.contiguous(), cl[:, :, :11, :11].contiguous(memory_format=torch.channels_last), cl.double(), cl.detach()):
        assert torch.equal(pool(x).nan_to_num(), F.max_pool2d(x, 2).nan_to_num())  # NCHW, odd sides, float64, inference
    with torch.no_grad():
        pool(cl)
    assert torch.func.grad(lambda t: pool(t).nan_to_num().sum())(cl).shape == cl.shape  # torch.func: eager's
    pool.padding = 1  # changed since: eager's
    assert torch.equal(pool(cl).nan_to_num(), F.max_pool2d(cl, 2, padding=1).nan_to_num())
    assert window_max_pool.pools(nn.Sequential(nn.MaxPool2d(3, stride=2), nn.MaxPool2d(2, padding=1), nn.MaxPool2d(2, ceil_mode=True))) == []


def test_a_gradient_penalty_differentiates_through_the_kernels_backward():
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    results = []
    for kernel in (False, True):
        pool = nn.MaxPool2d(2)
        window_max_pool.use([pool], kernel)
        leaf = x.clone().requires_grad_()
        out = pool(leaf)
        assert ("WindowMaxPool" in type(out.grad_fn).__name__) == kernel
        (grad,) = torch.autograd.grad(out.pow(2).sum(), leaf, create_graph=True)
        grad.pow(2).sum().backward()
        results.append((grad.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_past_its_budget_of_shapes_a_models_pools_run_eagers_and_another_models_keep_theirs(monkeypatch):
    full, fresh = nn.Sequential(nn.MaxPool2d(2), nn.MaxPool2d(2)), nn.Sequential(nn.MaxPool2d(2))
    window_max_pool.use(window_max_pool.pools(full), True)
    window_max_pool.use(window_max_pool.pools(fresh), True)
    assert full[0].kernels is full[1].kernels and fresh[0].kernels is not full[0].kernels  # one per model
    full[0].kernels.shapes.update((i,) for i in range(window_max_pool.budget()))
    ran = []
    monkeypatch.setattr(window_max_pool.Kernels, "__call__", lambda self, name: ran.append(self) or pytest.fail("stop"))
    x = crafted(torch.float32, 2).requires_grad_()
    assert torch.equal(full(x).nan_to_num(), F.max_pool2d(F.max_pool2d(x, 2), 2).nan_to_num()) and ran == []
    with pytest.raises(pytest.fail.Exception):
        fresh(x)
    assert ran == [fresh[0].kernels]  # its own budget: its kernels would be made
    window_max_pool.use(window_max_pool.pools(full), False)
    assert type(full[0]) is nn.MaxPool2d and "kernels" not in vars(full[0])  # handed back, and its cache with it


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def test_pool_kernel_when_faster_trains_as_channels_last_alone_does(monkeypatch, capsys):
    def timed(run, example, autocast):  # channels_last kept; the kernel (which needs it) faster still
        kernel = any(type(m) is WindowMaxPool2d for m in run.modules())
        layout = not next(run.parameters()).is_contiguous()
        return 0.5 if kernel and layout else (0.8 if layout else 1.0)

    monkeypatch.setattr(fast_path, "_timed", timed)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    trained = {}
    for candidates in (["channels_last"], ["channels_last", "pool_kernel"]):
        raw = net()
        strategy = loom.OneDeviceStrategy(device="cpu")
        model, opt = strategy.prepare(raw, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), fast_path=candidates, example_input=data[0][0])
        step = strategy.train_step(model, F.cross_entropy, opt)
        for x, y in data:
            step(x, y)
        trained[len(candidates)] = (raw, capsys.readouterr().out.splitlines()[-1])
    (plain, _), (fast, line) = trained[1], trained[2]
    assert line.startswith("loom: fast path channels_last+pool_kernel, 2.00x eager"), line
    assert type(fast[2]) is WindowMaxPool2d and type(plain[2]) is NhwcMaxPool2d  # the exact default
    assert list(fast.state_dict()) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(fast.state_dict()[key], value), key
    scripted = torch.jit.script(fast[2])  # compiles eager's pool
    x = torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    assert torch.equal(scripted(x), fast[2](x))


def test_pool_before_relu_still_swaps_a_relu_before_the_kernels_pool():
    model = net()
    fast_path.pool_before_relu(model, True)
    fast_path.apply(model, fast_path.FastPath(pool_kernel=True))
    assert type(model) is fast_path.PoolBeforeReluSequential and type(model[2]) is WindowMaxPool2d
    assert fast_path._swappable(model[1], model[2])
