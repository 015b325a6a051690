"""The CPU/GPU compute fast path, chosen by measuring the model on a batch at ``prepare`` time.

Opt-in, like ``torch.backends.cudnn.benchmark``: the choice depends on timings, so two runs
on a busy machine may choose differently, and trying ``torch.compile`` costs its compile time.
Candidates, each kept only if it is faster and numerically equivalent to eager (its outputs and
gradients on the batch within float tolerance of eager's, in the strategy's precision):

- ``"channels_last"``: convolution weights (and so activations) in NHWC, which oneDNN's
  convolutions run without reordering; only for models with 2-D convolutions. Its edges are
  channels_last too: the batch is converted once as it enters the model (a convolution would
  convert it in its forward and again in its backward), and the gradient of an ``nn.Flatten``'s
  input is given back channels_last (max-pool's backward takes a contiguous one by a slow path
  that copies its input and its result);
- ``"pool_before_relu"``: a ReLU followed by a max-pool in an ``nn.Sequential`` runs after it
  instead, on a quarter of the elements (2x2 pools). Max commutes with a non-decreasing function,
  and the gradient reaches the same element (the first largest, or none where the largest is not
  positive), so outputs and gradients are those of eager (a zero output may change sign); ReLU
  forward and backward were a sixth of a W2 step. Only the container's class changes, to
  ``PoolBeforeReluSequential`` (its forward): the modules stay where they are (names, indices,
  slices and the state dict are as before), a pair with hooks, even hooks added later, runs in
  its own order, and ``torch.jit.script`` compiles it as a plain ``nn.Sequential``;
- ``"pool_kernel"``: an ``nn.MaxPool2d`` whose windows tile a channels_last CPU input pools it
  with kernels that store each window's choice in a byte instead of eager's int64 index and write
  the input gradient in one pass (``loom.fast.window_max_pool``); bit for bit eager's. Its
  kernels are compiled by ``torch.compile`` on first use (seconds, once per input shape). Only
  the pool's class changes, to ``WindowMaxPool2d``;
- ``"compile"``: ``torch.compile`` (inductor), applied around the strategy's wrapper;
- ``"reuse_memory"``: glibc's malloc keeps freed memory for the next step instead of handing it
  back to the system, so activations of tens of MB do not page-fault afresh every step (on CPU
  these faults cost a W2 step a third of its time). Process-wide, it combines with either of the
  others; the process's resident memory then stays at its peak.

Reduced precision is never switched on here: ``precision="bf16-mixed"`` is how to ask for it.
oneDNN is already PyTorch's CPU path for convolutions (``torch.backends.mkldnn``), so it is not
a separate candidate. The trial leaves parameters, gradients, buffers (BatchNorm statistics)
and the random generator as they were; having tried reuse_memory, it leaves glibc's thresholds
fixed where they would slide to (glibc cannot be given their sliding back). Replicas decide together, on their
mean timings, so they all run the same program.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import math
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom import compat
from loom.fast import window_max_pool

CANDIDATES = ("channels_last", "pool_before_relu", "pool_kernel", "compile", "reuse_memory")
MIN_GAIN = 1.05  # a candidate must beat eager by this much: less is within the noise of a busy machine
FAULTS_WORTH = 1_000  # minor page faults a pass (4 MB) that reuse_memory may be kept for without a timed gain
ROUNDS = 3  # timed forward+backward passes per candidate, interleaved


@dataclass
class FastPath:
    """What the trial chose, and the timings behind it (seconds per forward+backward, median)."""

    channels_last: bool = False
    pool_before_relu: bool = False
    pool_kernel: bool = False
    compile: bool = False
    reuse_memory: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    faults: dict[str, float] = field(default_factory=dict)  # minor page faults a forward+backward, median
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not kept

    @property
    def name(self) -> str:
        return "+".join(n for n in CANDIDATES if getattr(self, n)) or "eager"

    def line(self) -> str:
        eager = self.seconds.get("eager", 0.0)
        timings = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in self.seconds.items())
        gain = f", {eager / self.seconds[self.name]:.2f}x eager" if self.name != "eager" else ""
        why = "".join(f"; {n}: {reason}" for n, reason in self.rejected.items())
        without = _without_reuse(self.name)
        if self.reuse_memory and _for_faults(self.name, self.seconds, self.faults) and self.seconds[without] / self.seconds[self.name] < MIN_GAIN:
            why += f"; reuse_memory kept for its page faults ({self.faults[without]:,.0f} a pass without it, {self.faults[self.name]:,.0f} with)"
        return f"loom: fast path {self.name}{gain} (forward+backward on the example batch: {timings}){why}"


def check_candidates(fast_path: bool | Sequence[str]) -> tuple[str, ...]:
    """The candidates ``fast_path`` asks for; an unknown one is refused in one line."""
    if fast_path is True:
        return CANDIDATES
    if fast_path is False:
        return ()
    if isinstance(fast_path, str) or not all(c in CANDIDATES for c in fast_path):
        raise ValueError(f"fast_path takes True, False or a list of candidates from {', '.join(CANDIDATES)}; got {fast_path!r}")
    return tuple(fast_path)


PARTS = "each process holds only part of the model, so the trial cannot judge a candidate on the whole"


def refuse(strategy: str, fast_path: bool | Sequence[str], why: str = PARTS) -> None:
    """For a strategy the trial cannot measure: one whose processes each hold part of the model (each
    would judge a candidate on its own part, and they could choose different programs), or XLA's."""
    if check_candidates(fast_path):
        raise ValueError(
            f"{strategy} does not take prepare(fast_path=...): {why}; drop fast_path (it is for MirroredStrategy and one device)"
        )


def choose(module: nn.Module, example: torch.Tensor, candidates: Sequence[str], autocast: Callable[[], Any], low_precision: bool = False) -> FastPath:
    """Time eager and each applicable candidate on ``example``; keep the fastest equivalent one.

    ``autocast()`` is the strategy's precision context (``low_precision`` when it computes in
    bf16 or fp16: then a candidate may differ from eager by as much as those round). A program
    of two parts (``reuse_memory`` with another) is kept only if it beats the best single one by
    ``MIN_GAIN``. The module is left as it was found: apply the choice with ``apply``
    (before wrapping) and ``torch.compile`` (after).
    """
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"prepare(..., example_input=...) takes one batch of inputs as a tensor, not {type(example).__name__}")
    plan = FastPath()
    programs: dict[str, nn.Module] = {"eager": module}
    if "channels_last" in candidates:
        if any(isinstance(m, nn.Conv2d) for m in module.modules()) and example.dim() == 4:
            programs["channels_last"] = module  # converted in place while timed
        else:
            plan.rejected["channels_last"] = "no 2-D convolution"
    if "pool_before_relu" in candidates:  # tried everywhere, refused where it has nothing to do: hooks may differ by replica
        programs.update({"+".join(p for p in (name, "pool_before_relu") if p != "eager"): module for name in list(programs)})
        if not _relu_pools(module):
            plan.rejected["pool_before_relu"] = "no nn.ReLU followed by an nn.MaxPool2d in an nn.Sequential (without hooks)"
    if "pool_kernel" in candidates:  # tried everywhere as well; an input it does not suit runs eager's pool
        programs.update({"+".join(p for p in (name, "pool_kernel") if p != "eager"): module for name in list(programs)})
        if example.device.type != "cpu":
            plan.rejected["pool_kernel"] = f"its kernels are for the CPU, the batch is on {example.device.type}"
        elif not window_max_pool.pools(module):
            plan.rejected["pool_kernel"] = "no nn.MaxPool2d whose windows tile its input (kernel == stride, no padding or dilation)"
    if "compile" in candidates:
        programs["compile"] = torch.compile(module)
    if "reuse_memory" in candidates:
        if _reusing:
            plan.rejected["reuse_memory"] = "this process reuses memory already (an earlier prepare chose it)"
        elif example.device.type == "cpu":
            programs.update({"+".join(p for p in (name, "reuse_memory") if p != "eager"): run for name, run in list(programs.items())})
            programs = {name: programs[name] for name in sorted(programs, key=_order)}
        else:
            plan.rejected["reuse_memory"] = f"the activations are in {example.device.type} memory, not the host's"
    tried_names = list(programs)  # the same on every replica: it depends on the model and the request only
    with _untouched(module):
        if any(_reuses(name) for name in programs) and _memory_refusal():
            plan.rejected["reuse_memory"] = _memory_refusal()
        reference = _grads(module, module, example, autocast)
        times: dict[str, list[float]] = {}
        faults: dict[str, list[float]] = {}
        set_here = False
        try:  # without reuse_memory first, on the allocator as found: once set, glibc's is set for good
            for reuse in (False, True):
                group = [name for name in programs if _reuses(name) == reuse and not any(part in plan.rejected for part in name.split("+"))]
                if reuse and group:
                    reuse_memory(True)
                    set_here = True
                for name in group[1:] if group and group[0] == "eager" else group:
                    if "+" not in name:  # a pair is made of parts checked on their own; reuse_memory's check fills its heap
                        with _program(module, name):
                            problem = _check(module, programs[name], example, autocast, reference, low_precision)
                        if problem:
                            plan.rejected[name] = problem
                group = [name for name in group if not any(part in plan.rejected for part in name.split("+"))]
                times.update({name: [] for name in group})
                faults.update({name: [] for name in group})
                for _ in range(ROUNDS):
                    for name in group:
                        with _program(module, name):
                            before = _minor_faults()
                            times[name].append(_timed(programs[name], example, autocast))
                            faults[name].append(_minor_faults() - before)
        finally:
            if set_here:
                reuse_memory(False)
    # Every replica sends a time for every program it tried (inf where its own check refused
    # one), so the all-reduce has one shape everywhere and a refusal anywhere drops it everywhere.
    tried = {name: statistics.median(times[name]) if name in times else math.inf for name in tried_names}
    tried.update({f"{name} faults": statistics.median(faults[name]) if name in faults else math.inf for name in tried_names})
    agreed = _agreed(tried)
    plan.seconds = {name: agreed[name] for name in tried_names if math.isfinite(agreed[name])}
    plan.faults = {name: agreed[f"{name} faults"] for name in plan.seconds}
    for name in tried_names:
        if name not in plan.seconds and not any(part in plan.rejected for part in name.split("+")):
            plan.rejected[name] = "computes differently on another replica, not kept"
    chosen = "eager"
    for name in sorted(plan.seconds, key=lambda n: (n.count("+"), plan.seconds[n])):
        if plan.seconds[chosen] / plan.seconds[name] >= MIN_GAIN:
            chosen = name
        elif _without_reuse(name) == chosen and _for_faults(name, plan.seconds, plan.faults):
            chosen = name
    for part in chosen.split("+"):
        if part != "eager":
            setattr(plan, part, True)
    for name in plan.seconds:
        if name != "eager" and "+" not in name and not getattr(plan, name):
            plan.rejected.setdefault(name, f"{plan.seconds['eager'] / plan.seconds[name]:.2f}x eager, not kept")
    return plan


def _without_reuse(name: str) -> str:
    return "+".join(p for p in name.split("+") if p != "reuse_memory") or "eager"


def _for_faults(name: str, seconds: dict[str, float], faults: dict[str, float]) -> bool:
    """Whether ``name`` adds reuse_memory to a program that faults thousands of pages a pass, ends
    nearly all of them, and is not slower beyond the noise: its gain is sure in the faults, less
    so in a forward+backward's time than in a training step's (a step frees and allocates more)."""
    without = _without_reuse(name)
    if not _reuses(name) or without not in seconds or name not in faults:
        return False
    cut = faults[without] >= FAULTS_WORTH and faults[name] <= faults[without] / 10
    return cut and seconds[without] / seconds[name] >= 1 / MIN_GAIN


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _reuses(name: str) -> bool:
    return "reuse_memory" in name.split("+")


def _order(name: str) -> tuple[int, int]:
    """Singles before pairs, each in ``CANDIDATES``' order: a pair's parts are judged first."""
    parts = name.split("+")
    return len(parts), CANDIDATES.index(parts[0]) if parts[0] in CANDIDATES else -1


def apply(module: nn.Module, plan: FastPath) -> None:
    """Convert the parameters in place (the optimizer keeps the same ``Parameter`` objects),
    reorder ReLUs and max-pools, and set the allocator for the rest of the process when
    ``reuse_memory`` was chosen."""
    if plan.channels_last:
        module.to(memory_format=torch.channels_last)
        _channels_last_edges(module)
    if plan.pool_before_relu:
        _pool_before_relu(_relu_pools(module), True)
    if plan.pool_kernel:
        window_max_pool.use(window_max_pool.pools(module), True)
    if plan.reuse_memory:
        reuse_memory(True)


def _run(module: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> torch.Tensor:
    with autocast():
        out = module(example)
    return out.float()


def _grads(module: nn.Module, run: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    out = _run(run, example, autocast)
    out.sum().backward()
    return [out.detach()] + [p.grad.clone() if p.grad is not None else torch.zeros(()) for p in module.parameters()]


def _check(module: nn.Module, run: nn.Module, example: torch.Tensor, autocast: Callable[[], Any], reference: list[torch.Tensor], low_precision: bool) -> str | None:
    """Why ``run`` is not to be kept, or None: it fails on the batch (a ``view`` of a
    channels_last activation, an op ``torch.compile`` cannot take), or computes differently."""
    try:
        got = _grads(module, run, example, autocast)
    except Exception as error:  # noqa: BLE001 -- any failure of a candidate only refuses it
        return f"fails on the example batch ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}), not kept"
    return _difference(reference, got, tolerance=2e-2 if low_precision else 1e-4)


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
            return f"differs from eager by {error:.1e} (relative) in its {what}, not kept"
    return None


def _agreed(seconds: dict[str, float]) -> dict[str, float]:
    """Every replica's mean timings, so all of them choose the same."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seconds
    values = torch.tensor(list(seconds.values()), dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(seconds, (values / dist.get_world_size()).tolist()))


@contextmanager
def _program(module: nn.Module, name: str) -> Iterator[None]:
    """``module`` rewritten as program ``name`` asks (channels_last, pool_before_relu, pool_kernel) while timed."""
    parts = name.split("+")
    containers = _relu_pools(module) if "pool_before_relu" in parts else []
    pools = window_max_pool.pools(module) if "pool_kernel" in parts else []
    with _layout(module, "channels_last" in parts):
        _pool_before_relu(containers, True)
        window_max_pool.use(pools, True)
        try:
            yield
        finally:
            window_max_pool.use(pools, False)
            _pool_before_relu(containers, False)


def _relu_pools(module: nn.Module) -> list[nn.Sequential]:
    """The plain ``nn.Sequential`` containers (a subclass may run its modules in another order) in
    which an ``nn.ReLU`` runs just before an ``nn.MaxPool2d``, neither of them hooked."""
    return [m for m in module.modules() if type(m) is nn.Sequential and "forward" not in vars(m) and _has_pairs(m)]


def _has_pairs(container: nn.Sequential) -> bool:
    modules = list(container)
    return any(_swappable(a, b) for a, b in zip(modules, modules[1:]))


def _swappable(relu: Any, pool: Any) -> bool:
    """A hook would see other values (a hook on the ReLU, pooled ones), so hooked modules are not."""
    if type(relu) is not nn.ReLU or type(pool) not in (nn.MaxPool2d, window_max_pool.WindowMaxPool2d) or pool.return_indices:
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


# glibc's malloc serves a block above its threshold by mmap and unmaps it at free, and trims
# the top of its heap beyond another: so each step faults its activations' pages in afresh.
# The threshold slides up to 32 MiB as such blocks are freed, until a mallopt(3) fixes it.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}  # no mmap, no trim: freed memory serves the next step
SLID = {M_MMAP_MAX: 65536, M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}  # where glibc's thresholds slide to
_reusing = False  # process-wide, as the allocator is


def reuse_memory(on: bool) -> None:
    """Keep freed memory in the process for the next step (``on``), or not: then glibc's
    thresholds are fixed where they slide to, as it cannot be given their sliding back."""
    global _reusing
    if _memory_refusal():
        raise RuntimeError(f"reuse_memory cannot be set here: {_memory_refusal()}")
    for parameter, value in (KEEP if on else SLID).items():
        _glibc().mallopt(parameter, value)
    _reusing = on


@functools.cache
def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # musl has no such function, and other mallopt parameters
    except (OSError, AttributeError):
        return None
    return libc


def _memory_refusal() -> str | None:
    """Why this process's allocator is not glibc's to set, or None."""
    if _glibc() is None:
        return "it sets glibc's malloc, and this process has no glibc"
    tuned = [k for k in os.environ if k.startswith("MALLOC_")]
    tuned += [k for k in ("LD_PRELOAD", "GLIBC_TUNABLES") if "malloc" in os.environ.get(k, "")]
    if tuned:
        return f"the process sets its allocator already ({', '.join(sorted(tuned))}), which it would override"
    return None


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

