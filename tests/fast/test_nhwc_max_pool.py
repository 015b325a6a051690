"""The fast path's exact pool_nhwc: a contiguous batch pooled by eager's channels_last kernel, eager's bit for bit."""

import pytest
import torch
import torch.autograd.forward_ad as fw
import torch.nn.functional as F
from torch import nn

import loom
from loom.fast import nhwc_max_pool, window_max_pool
from loom.fast.nhwc_max_pool import NhwcMaxPool2d
from tests.fast.test_fast_path import kept_memory  # noqa: F401 -- a fixture

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float64: torch.int64}
OPTIONS = [  # kernel, stride, padding, dilation, ceil_mode
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=2, ceil_mode=True),
    dict(kernel_size=3, stride=1, dilation=2),
]


def crafted(dtype: torch.dtype, side: int = 64) -> torch.Tensor:
    """A contiguous batch of 16 channels with ties, signed zeros, windows of one and of several NaNs, and -inf."""
    flat = torch.randn(4 * 16 * side * side, generator=torch.Generator().manual_seed(0)).to(dtype)
    flat[::7], flat[::11], flat[::29], flat[1::29], flat[::31] = 0.0, -0.0, float("nan"), float("nan"), float("-inf")
    ties = torch.arange(5, len(flat) - 1, 13)
    flat[ties] = flat[ties + 1]
    return flat.view(4, 16, side, side)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN payloads aside (eager's bf16 kernel gives a NaN back through fp32)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a.masked_fill(nan, 0)), bits(b.masked_fill(nan, 0)))


def pooled(x: torch.Tensor, options: dict, nhwc: bool) -> tuple[torch.Tensor, torch.Tensor, str]:
    pool = nn.MaxPool2d(**options)
    if nhwc:
        nhwc_max_pool.use(nn.Sequential(pool))
    leaf = x.clone().requires_grad_()
    out = pool(leaf)
    grad = torch.arange(out.numel(), dtype=x.dtype).view_as(out) % 7 - 3  # each output's own gradient shows where it goes
    grad[..., 0] = -0.0
    out.backward(grad)
    return out, leaf.grad, type(out.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_outputs_and_gradients_are_eagers_bit_for_bit(dtype, options):
    x = crafted(dtype, side=65 if options.get("ceil_mode") else 64)
    want, want_grad, eager = pooled(x, options, nhwc=False)
    got, got_grad, ours = pooled(x, options, nhwc=True)
    assert eager == "MaxPool2DWithIndicesBackward0" and ours == "_NhwcPoolBackward"  # the channels_last kernel ran
    assert got.stride() == want.stride() and got_grad.stride() == want_grad.stride()
    assert same(got, want) and same(got_grad, want_grad)


def test_a_global_pool_gives_eagers_strides_so_what_follows_computes_alike():
    """A channels_last result of 1x1 sides counts as contiguous but keeps channels_last strides; a convolution after
    it would take that layout, and round differently."""
    x = torch.randn(64, 64, 8, 8, generator=torch.Generator().manual_seed(0))
    plain, fast, conv = nn.MaxPool2d(8), nn.MaxPool2d(8), nn.Conv2d(64, 32, 1)
    nhwc_max_pool.use(nn.Sequential(fast))
    for leaf in (x, x.clone().requires_grad_()):
        assert fast(leaf).stride() == plain(leaf).stride() == (64, 1, 1, 1)
        assert torch.equal(conv(fast(leaf)), conv(plain(leaf)))


def test_forward_mode_gradients_are_eagers():
    x = crafted(torch.float32).nan_to_num(0.0)
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    plain, fast = nn.MaxPool2d(2), nn.MaxPool2d(2)
    nhwc_max_pool.use(nn.Sequential(fast))
    with fw.dual_level():
        duals = [pool(fw.make_dual(x.clone().requires_grad_(), tangent)) for pool in (plain, fast)]
        assert type(duals[1].grad_fn).__name__ == "_NhwcPoolBackward"
        want, got = (fw.unpack_dual(d) for d in duals)
        assert torch.equal(got.primal, want.primal) and torch.equal(got.tangent, want.tangent)
    assert torch.equal(torch.func.jvp(fast, (x,), (tangent,))[1], torch.func.jvp(plain, (x,), (tangent,))[1])


def test_inference_and_a_gradient_penalty_are_eagers():
    x = crafted(torch.float32).nan_to_num(0.0)
    plain, fast = nn.MaxPool2d(2), nn.MaxPool2d(2)
    nhwc_max_pool.use(nn.Sequential(fast))
    with torch.no_grad():
        assert torch.equal(bits(fast(x)), bits(plain(x))) and fast(x).is_contiguous()
    results = []
    for pool in (plain, fast):
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(pool(leaf).pow(2).sum(), leaf, create_graph=True)
        grad.pow(2).sum().backward()
        results.append((grad.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_batches_it_would_not_speed_up_run_eagers_pool(monkeypatch):
    pool = nn.MaxPool2d(2)
    nhwc_max_pool.use(nn.Sequential(pool))
    x = crafted(torch.float32).requires_grad_()
    for batch in (x[:, :8], x[:, :, :16, :16], x.contiguous(memory_format=torch.channels_last), x.transpose(2, 3), x[0]):
        assert type(pool(batch).grad_fn).__name__ == "MaxPool2DWithIndicesBackward0"  # few channels, small, channels_last, strided, unbatched
    assert pool(x.detach().to_mkldnn()).layout == torch._mkldnn  # oneDNN's own layout
    pool.return_indices = True
    assert len(pool(x)) == 2
    pool.return_indices = False
    monkeypatch.setattr(nhwc_max_pool, "_pooled", lambda *_: pytest.fail("the channels_last path ran"))
    assert torch.func.grad(lambda t: pool(t).nan_to_num().sum())(x).shape == x.shape  # torch.func: eager's
    assert torch.compile(pool, backend="eager")(x).shape == (4, 16, 32, 32)  # dynamo traces eager's


def test_pool_kernel_takes_the_pool_and_gives_it_back_as_it_was():
    net = nn.Sequential(nn.MaxPool2d(2))
    nhwc_max_pool.use(net)
    window_max_pool.use(window_max_pool.pools(net), True)
    assert type(net[0]) is window_max_pool.WindowMaxPool2d
    assert type(net[0](crafted(torch.float32).requires_grad_()).grad_fn).__name__ == "_NhwcPoolBackward"  # contiguous: pool_nhwc's
    window_max_pool.use(window_max_pool.pools(net), False)
    assert type(net[0]) is NhwcMaxPool2d and not {"kernels", "plain_class"} & set(vars(net[0]))


def test_torchscript_compiles_eagers_pool_and_leaves_the_model_as_it_was():
    net = nn.Sequential(nn.MaxPool2d(2))
    nhwc_max_pool.use(net)
    pool, x = net[0], crafted(torch.float32)
    scripted = torch.jit.script(net)
    assert net[0] is pool and type(pool) is NhwcMaxPool2d  # torch writes what __prepare_scriptable__ gives back into the model
    compiled = scripted._modules["0"]
    assert compiled.original_name == "NhwcMaxPool2d" and "_max_pool2d\n" in compiled.code  # eager's, in TorchScript
    assert same(scripted(x), F.max_pool2d(x, 2))


def test_a_cnn_trains_at_the_defaults_bit_for_bit_as_plain_eager(capsys, kept_memory):  # noqa: F811
    def run(fast_path) -> tuple[dict, nn.Module]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 32 * 32, 3))
        strategy = loom.OneDeviceStrategy(device="cpu")
        model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), fast_path=fast_path)
        step = strategy.train_step(model, F.cross_entropy, opt)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            step(torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 3, (8,), generator=g))
        return net.state_dict(), net

    plain, _ = run(False)
    fast, net = run(None)
    assert type(net[2]) is NhwcMaxPool2d and "pool_nhwc (1 nn.MaxPool2d" in capsys.readouterr().err
    for key, value in plain.items():
        assert torch.equal(fast[key], value), key
