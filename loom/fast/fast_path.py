"""The CPU/GPU compute fast path: exact speed-ups on by default, inexact ones chosen by a trial.

Exact candidates change no number, so every CPU job gets them without asking (``prepare``
applies them; ``fast_path=False`` turns them off, ``loom.fast.exact``):

- ``"reuse_memory"``: glibc's malloc keeps freed memory for the next step (``loom.fast.allocator``:
  set by loom's launcher through glibc tunables, or by ``mallopt`` in a process it did not start);
- ``"pool_before_relu"``: a ReLU followed by a max-pool in an ``nn.Sequential`` runs after it
  instead, on a quarter of the elements (2x2 pools). Max commutes with a non-decreasing function,
  and the gradient reaches the same element (the first largest, or none where the largest is not
  positive), so outputs and gradients are those of eager (a zero output may change sign); ReLU
  forward and backward were a sixth of a W2 step. Only the container's class changes, to
  ``PoolBeforeReluSequential`` (its forward): the modules stay where they are (names, indices,
  slices and the state dict are as before), a pair with hooks, even hooks added later, runs in
  its own order, and ``torch.jit.script`` compiles it as a plain ``nn.Sequential``;
- ``"pool_nhwc"``: an ``nn.MaxPool2d`` given a contiguous (NCHW) CPU batch of 16 channels or more
  pools a channels_last copy of it with eager's channels_last kernel, which compares a vector of
  channels at a time where the contiguous one compares one element (``loom.fast.nhwc_max_pool``):
  the same windows scanned alike, so the same outputs, indices and gradients; W2's step
  1.15-1.17x faster (``bench/pool_nhwc.py``).

Inexact candidates round differently from eager, so they are opt-in (``fast_path=True`` or a
list, with ``example_input``), timed against eager on that batch and kept only if faster and
within a tolerance derived from the precision and the model's reduction sizes (``tolerance``):

- ``"channels_last"``: convolution weights (and so activations) in NHWC, which oneDNN's
  convolutions run without reordering; only for models with 2-D convolutions. Its edges are
  channels_last too: the batch is converted once as it enters the model (a convolution would
  convert it in its forward and again in its backward), and the gradient of an ``nn.Flatten``'s
  input is given back channels_last (max-pool's backward takes a contiguous one by a slow path
  that copies its input and its result);
- ``"pool_kernel"``: an ``nn.MaxPool2d`` whose windows tile a channels_last CPU input pools it
  with kernels that store each window's choice in a byte instead of eager's int64 index and write
  the input gradient in one pass (``loom.fast.window_max_pool``). Its kernels are compiled by
  ``torch.compile`` on first use (seconds, once per input shape, for this model alone);
- ``"compile"``: ``torch.compile`` (inductor), applied around the strategy's wrapper.

The trial measures each contender as it will run: the exact speed-ups (the allocator is
process-wide) are applied before anything is timed; each contender runs once untimed (compiling,
filling the allocator's heap), then ``ROUNDS`` rounds time every contender once each, in an order
that rotates from round to round, and the median counts. Reduced precision is never switched on
here: ``precision="bf16-mixed"`` is how to ask for it. The trial leaves parameters, gradients,
buffers (BatchNorm statistics) and the random generator as they were. Replicas decide together,
on their mean timings, so they all run the same program.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom import compat
from loom.fast import window_max_pool

EXACT = ("reuse_memory", "pool_before_relu", "pool_nhwc")  # change no number: on by default
INEXACT = ("channels_last", "pool_kernel", "compile")  # round differently: opt-in, behind a tolerance
CANDIDATES = ("channels_last", "pool_before_relu", "pool_nhwc", "pool_kernel", "compile", "reuse_memory")
MIN_GAIN = 1.05  # a candidate must beat eager by this much: less is within the noise of a busy machine
ROUNDS = 5  # timed forward+backward passes per contender, after one untimed, in rotating order
ROUNDINGS = 8  # roundings the tolerance allows for: a few layers' worth


@dataclass
class FastPath:
    """What the trial chose, and the timings behind it (seconds per forward+backward, median)."""

    channels_last: bool = False
    pool_kernel: bool = False
    compile: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not kept
    tolerance: str = ""  # the tolerance and what it was derived from
    kernels: window_max_pool.Kernels = field(default_factory=window_max_pool.Kernels, repr=False, compare=False)  # pool_kernel's, this model's

    @property
    def name(self) -> str:
        return "+".join(n for n in INEXACT if getattr(self, n)) or "eager"

    def line(self) -> str:
        eager = self.seconds.get("eager", 0.0)
        timings = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in self.seconds.items())
        gain = f", {eager / self.seconds[self.name]:.2f}x eager" if self.name != "eager" else ""
        why = "".join(f"; {n}: {reason}" for n, reason in self.rejected.items())
        within = f", {self.tolerance}" if self.tolerance else ""
        return f"loom: fast path {self.name}{gain} (forward+backward on the example batch: {timings}{within}){why}"


def check_candidates(fast_path: bool | Sequence[str] | None) -> tuple[str, ...]:
    """The inexact candidates ``fast_path`` asks the trial for (exact ones are on unless it is
    False); an unknown one is refused in one line."""
    if fast_path is True:
        return INEXACT
    if fast_path is None or fast_path is False:
        return ()
    if isinstance(fast_path, str) or not all(c in CANDIDATES for c in fast_path):
        raise ValueError(f"fast_path takes True, False or a list of candidates from {', '.join(CANDIDATES)}; got {fast_path!r}")
    return tuple(c for c in INEXACT if c in fast_path)


PARTS = "each process holds only part of the model, so the trial cannot judge a candidate on the whole"


def refuse(strategy: str, fast_path: bool | Sequence[str] | None, why: str = PARTS) -> None:
    """For a strategy the trial cannot measure: one whose processes each hold part of the model (each
    would judge a candidate on its own part, and they could choose different programs), or XLA's.
    The exact allocator settings still apply to its processes."""
    if check_candidates(fast_path):
        raise ValueError(
            f"{strategy} does not take prepare(fast_path=...): {why}; drop fast_path (its trial is for MirroredStrategy "
            "and one device; the exact speed-ups apply without it)"
        )


def choose(module: nn.Module, example: torch.Tensor, candidates: Sequence[str], autocast: Callable[[], Any], dtype: torch.dtype | None = None) -> FastPath:
    """Time eager and each applicable inexact candidate on ``example``; keep the fastest within tolerance.

    ``autocast()`` is the strategy's precision context (``dtype`` what it computes in, when it
    is not fp32). A program of two parts (``channels_last+pool_kernel``) is kept only if it
    beats the best single one by ``MIN_GAIN``. The module is left as it was found: apply the
    choice with ``apply`` (before wrapping) and ``torch.compile`` (after).
    """
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"prepare(..., example_input=...) takes one batch of inputs as a tensor, not {type(example).__name__}")
    plan = FastPath()
    programs = _programs(module, example, candidates, plan)
    tried_names = list(programs)  # the same on every replica: it depends on the model and the request only
    with _untouched(module):
        reference, reductions = _reference(module, example, autocast)
        tolerance = tolerance_for(dtype, reductions)
        plan.tolerance = f"tolerance {tolerance:.1e} ({_dtype_name(dtype)}, longest reduction {reductions:,})"
        for name in tried_names[1:]:
            if not any(part in plan.rejected for part in name.split("+")):
                with _program(module, name, plan.kernels):
                    problem = _check(module, programs[name], example, autocast, reference, tolerance)
                if problem:
                    plan.rejected[name] = problem
        timed = [name for name in tried_names if name not in plan.rejected and not any(part in plan.rejected for part in name.split("+"))]
        times = _alternating(module, programs, timed, example, autocast, plan.kernels)
    # Every replica sends a time for every program it tried (inf where its own check refused
    # one), so the all-reduce has one shape everywhere and a refusal anywhere drops it everywhere.
    agreed = _agreed({name: statistics.median(times[name]) if name in times else math.inf for name in tried_names})
    plan.seconds = {name: agreed[name] for name in tried_names if math.isfinite(agreed[name])}
    for name in tried_names:
        if name not in plan.seconds and not any(part in plan.rejected for part in name.split("+")):
            plan.rejected[name] = "computes differently on another replica, not kept"
    chosen = "eager"
    for name in sorted(plan.seconds, key=lambda n: (n.count("+"), plan.seconds[n])):
        if plan.seconds[chosen] / plan.seconds[name] >= MIN_GAIN:
            chosen = name
    for part in chosen.split("+"):
        if part != "eager":
            setattr(plan, part, True)
    for name in plan.seconds:
        if name != "eager" and "+" not in name and not getattr(plan, name):
            plan.rejected.setdefault(name, f"{plan.seconds['eager'] / plan.seconds[name]:.2f}x eager, not kept")
    return plan


def _programs(module: nn.Module, example: torch.Tensor, candidates: Sequence[str], plan: FastPath) -> dict[str, nn.Module]:
    """The contenders to time, eager first; a candidate with nothing to do here is rejected in ``plan``."""
    programs: dict[str, nn.Module] = {"eager": module}
    if "channels_last" in candidates:
        if any(isinstance(m, nn.Conv2d) for m in module.modules()) and example.dim() == 4:
            programs["channels_last"] = module  # converted in place while timed
        else:
            plan.rejected["channels_last"] = "no 2-D convolution"
    if "pool_kernel" in candidates:  # tried everywhere: an input it does not suit runs eager's pool
        programs.update({"+".join(p for p in (name, "pool_kernel") if p != "eager"): module for name in list(programs)})
        if example.device.type != "cpu":
            plan.rejected["pool_kernel"] = f"its kernels are for the CPU, the batch is on {example.device.type}"
        elif not window_max_pool.pools(module):
            plan.rejected["pool_kernel"] = "no nn.MaxPool2d whose windows tile its input (kernel == stride, no padding or dilation)"
    if "compile" in candidates:
        programs["compile"] = torch.compile(module)
    return programs


def _alternating(
    module: nn.Module, programs: dict[str, nn.Module], names: list[str], example: torch.Tensor, autocast: Callable[[], Any], kernels: Any
) -> dict[str, list[float]]:
    """Seconds of each contender's forward+backward: one untimed pass each (compiles, first-call
    costs, the heap filled), then ``ROUNDS`` rounds of one pass each, the order rotating, so that
    a slow spell of the machine or a warming cache falls on every contender alike."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(-1, ROUNDS):
        shift = max(r, 0) % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            with _program(module, name, kernels):
                seconds = _timed(programs[name], example, autocast)
            if r >= 0:
                times[name].append(seconds)
    return times


def tolerance_for(dtype: torch.dtype | None, reduction: int) -> float:
    """How far (relative to the largest value) a program that only rounds differently from eager
    may land: ``ROUNDINGS`` x (one rounding in the computing dtype + the reassociation of the
    longest fp32 sum, whose error grows as the square root of its length). For W2 in fp32
    (a weight gradient summed over 256 x 32 x 32 positions) that is 4.9e-4; in bf16, 6.3e-2."""
    unit = torch.finfo(dtype or torch.float32).eps
    return ROUNDINGS * (unit + math.sqrt(max(reduction, 1)) * torch.finfo(torch.float32).eps)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16").replace("float16", "fp16")


def apply(module: nn.Module, plan: FastPath) -> None:
    """Convert the parameters in place (the optimizer keeps the same ``Parameter`` objects) and
    give the model's tiling max-pools their kernels, as the trial chose."""
    if plan.channels_last:
        module.to(memory_format=torch.channels_last)
        _channels_last_edges(module)
    if plan.pool_kernel:
        window_max_pool.use(window_max_pool.pools(module), True, plan.kernels)


def pool_before_relu(module: nn.Module, on: bool) -> int:
    """Run every swappable ReLU after the max-pool that follows it (``on``), or in eager's order
    again; the number of containers changed."""
    containers = _relu_pools(module) if on else [m for m in module.modules() if type(m) is PoolBeforeReluSequential]
    _pool_before_relu(containers, on)
    return len(containers)


def _run(module: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> torch.Tensor:
    with autocast():
        out = module(example)
    return out.float()


def _grads(module: nn.Module, run: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    out = _run(run, example, autocast)
    out.sum().backward()
    return [out.detach()] + [p.grad.clone() if p.grad is not None else torch.zeros(()) for p in module.parameters()]


def _reference(module: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> tuple[list[torch.Tensor], int]:
    """Eager's output and gradients on the batch, and the longest sum they took (``_reductions``)."""
    lengths: list[int] = []
    hooks = [m.register_forward_hook(_reductions(lengths)) for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    try:
        got = _grads(module, module, example, autocast)
    finally:
        for hook in hooks:
            hook.remove()
    return got, max(lengths + [got[0].numel()])  # the output is summed into the loss


def _reductions(lengths: list[int]) -> Callable[..., None]:
    """A forward hook noting a layer's longest sums: an output element sums the inputs one output
    channel sees (its weight's numel over the output channels); a weight's gradient sums over
    every output position (the output's numel over its channels)."""

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        weight = getattr(module, "weight", None)
        if isinstance(out, torch.Tensor) and out.dim() and isinstance(weight, torch.Tensor) and weight.dim():
            channels = weight.shape[0]
            lengths.extend([weight.numel() // channels, out.numel() // max(out.shape[1] if out.dim() > 1 else out.shape[0], 1)])

    return hook


def _check(module: nn.Module, run: nn.Module, example: torch.Tensor, autocast: Callable[[], Any], reference: list[torch.Tensor], tolerance: float) -> str | None:
    """Why ``run`` is not to be kept, or None: it fails on the batch (a ``view`` of a
    channels_last activation, an op ``torch.compile`` cannot take), or computes differently."""
    try:
        got = _grads(module, run, example, autocast)
    except Exception as error:  # noqa: BLE001 -- any failure of a candidate only refuses it
        return f"fails on the example batch ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}), not kept"
    return _difference(reference, got, tolerance)


def _timed(run: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> float:
    start = time.perf_counter()
    _run(run, example, autocast).sum().backward()
    if example.is_cuda:
        torch.cuda.synchronize(example.device)
    return time.perf_counter() - start


def _difference(reference: list[torch.Tensor], got: list[torch.Tensor], tolerance: float) -> str | None:
    """Why ``got`` (output, then gradients) is not ``reference`` within a relative tolerance, or None.

    Gradients are measured against the largest of them: a parameter whose gradient is near zero
    (a bias before BatchNorm) would otherwise turn rounding into a large relative error.
    """
    parts = {"output": (reference[:1], got[:1]), "gradients": (reference[1:], got[1:])}
    for what, (want, have) in parts.items():
        scale = max([a.abs().max().item() for a in want if a.numel()] + [1e-12])
        error = max([(a.float() - b.float()).abs().max().item() for a, b in zip(want, have) if a.numel()] + [0.0]) / scale
        if error > tolerance:
            return f"differs from eager by {error:.1e} (relative) in its {what}, beyond the tolerance {tolerance:.1e}, not kept"
    return None


def _agreed(seconds: dict[str, float]) -> dict[str, float]:
    """Every replica's mean timings, so all of them choose the same."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seconds
    values = torch.tensor(list(seconds.values()), dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(seconds, (values / dist.get_world_size()).tolist()))


@contextmanager
def _program(module: nn.Module, name: str, kernels: window_max_pool.Kernels) -> Iterator[None]:
    """``module`` rewritten as program ``name`` asks (channels_last, pool_kernel) while timed."""
    parts = name.split("+")
    pools = window_max_pool.pools(module) if "pool_kernel" in parts else []
    with _layout(module, "channels_last" in parts):
        window_max_pool.use(pools, True, kernels)
        try:
            yield
        finally:
            window_max_pool.use(pools, False)


def _relu_pools(module: nn.Module) -> list[nn.Sequential]:
    """The plain ``nn.Sequential`` containers (a subclass may run its modules in another order) in
    which an ``nn.ReLU`` runs just before an ``nn.MaxPool2d``, neither of them hooked."""
    return [m for m in module.modules() if type(m) is nn.Sequential and "forward" not in vars(m) and _has_pairs(m)]


def _has_pairs(container: nn.Sequential) -> bool:
    modules = list(container)
    return any(_swappable(a, b) for a, b in zip(modules, modules[1:]))


def _swappable(relu: Any, pool: Any) -> bool:
    """A hook would see other values (a hook on the ReLU, pooled ones), so hooked modules are not."""
    if type(relu) is not nn.ReLU or type(pool) not in window_max_pool.MAX_POOLS or pool.return_indices:
        return False
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return not compat.global_module_hooks() and not any(getattr(m, h) for m in (relu, pool) for h in hooks)


def _pool_before_relu(containers: list[nn.Sequential], on: bool) -> None:
    """Give each container the class whose forward runs the pairs pool first, or take it back."""
    for container in containers:
        compat.swap_class(container, PoolBeforeReluSequential if on else nn.Sequential)


class PoolBeforeReluSequential(nn.Sequential):
    """An ``nn.Sequential`` whose forward runs each ReLU that a max-pool follows after the pool
    (the fast path's ``pool_before_relu``). A pair is checked at each call: a module replaced
    or hooked since runs in its own order."""

    def forward(self, input: Any) -> Any:
        modules = list(self)
        i = 0
        while i < len(modules):
            if i + 1 < len(modules) and _swappable(modules[i], modules[i + 1]):
                input = modules[i](modules[i + 1](input))
                i += 2
            else:
                input = modules[i](input)
                i += 1
        return input

    def __prepare_scriptable__(self) -> nn.Sequential:
        """What ``torch.jit.script`` compiles: the same modules as a plain ``nn.Sequential``
        (TorchScript cannot take the checks above; the values are the same in eager's order)."""
        plain = copy.copy(self)
        compat.swap_class(plain, nn.Sequential)
        return plain


@contextmanager
def _layout(module: nn.Module, channels_last: bool) -> Iterator[None]:
    if not channels_last:
        yield
        return
    module.to(memory_format=torch.channels_last)
    hooks = _channels_last_edges(module)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        module.to(memory_format=torch.contiguous_format)


def _channels_last_edges(module: nn.Module) -> list[Any]:
    hooks = [module.register_forward_pre_hook(_batch_channels_last)]
    return hooks + [m.register_forward_pre_hook(_gradient_channels_last) for m in module.modules() if isinstance(m, nn.Flatten)]


def _batch_channels_last(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)


def _gradient_channels_last(module: nn.Module, args: tuple) -> None:
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4 and args[0].requires_grad:
        args[0].register_hook(_channels_last)  # the gradient that reaches the layer before


def _channels_last(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous(memory_format=torch.channels_last)


@contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Parameters, gradients, buffers and the random generator restored after the trial."""
    params = [p.detach().clone() for p in module.parameters()]
    grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    buffers = [b.clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved, grad in zip(module.parameters(), params, grads):
                p.copy_(saved)
                p.grad = grad
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

