"""The CPU/GPU compute fast path, chosen by measuring the model on a batch at ``prepare`` time.

Opt-in, like ``torch.backends.cudnn.benchmark``: the choice depends on timings, so two runs
on a busy machine may choose differently, and trying ``torch.compile`` costs its compile time.
Candidates, each kept only if it is faster and numerically equivalent to eager (its outputs and
gradients on the batch within float tolerance of eager's, in the strategy's precision):

- ``"channels_last"``: convolution weights (and so activations) in NHWC, which oneDNN's
  convolutions run without reordering; only for models with 2-D convolutions;
- ``"compile"``: ``torch.compile`` (inductor), applied around the strategy's wrapper.

Reduced precision is never switched on here: ``precision="bf16-mixed"`` is how to ask for it.
oneDNN is already PyTorch's CPU path for convolutions (``torch.backends.mkldnn``), so it is not
a separate candidate. The trial leaves no trace: parameters, gradients, buffers (BatchNorm
statistics) and the random generator are as they were. Replicas decide together, on their
mean timings, so they all run the same program.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

CANDIDATES = ("channels_last", "compile")
MIN_GAIN = 1.05  # a candidate must beat eager by this much: less is within the noise of a busy machine
ROUNDS = 3  # timed forward+backward passes per candidate, interleaved


@dataclass
class FastPath:
    """What the trial chose, and the timings behind it (seconds per forward+backward, median)."""

    channels_last: bool = False
    compile: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not kept

    @property
    def name(self) -> str:
        return "+".join(n for n in CANDIDATES if getattr(self, n)) or "eager"

    def line(self) -> str:
        eager = self.seconds.get("eager", 0.0)
        timings = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in self.seconds.items())
        gain = f", {eager / self.seconds[self.name]:.2f}x eager" if self.name != "eager" else ""
        why = "".join(f"; {n}: {reason}" for n, reason in self.rejected.items())
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
    bf16 or fp16: then a candidate may differ from eager by as much as those round). The module is left as it was found:
    apply the choice with ``apply_layout`` (before wrapping) and ``torch.compile`` (after).
    """
    if not isinstance(example, torch.Tensor):
        raise TypeError(f"prepare(..., example_input=...) takes one batch of inputs as a tensor, not {type(example).__name__}")
    plan = FastPath()
    runs = {"eager": module}
    if "channels_last" in candidates:
        if any(isinstance(m, nn.Conv2d) for m in module.modules()) and example.dim() == 4:
            runs["channels_last"] = "channels_last"  # converted in place while timed
        else:
            plan.rejected["channels_last"] = "no 2-D convolution"
    if "compile" in candidates:
        runs["compile"] = torch.compile(module)
    tried_names = list(runs)
    with _untouched(module):
        reference = _grads(module, module, example, autocast)
        for name, run in list(runs.items())[1:]:
            with _layout(module, name == "channels_last"):
                got = _grads(module, module if isinstance(run, str) else run, example, autocast)
            problem = _difference(reference, got, tolerance=2e-2 if low_precision else 1e-4)
            if problem:
                plan.rejected[name] = problem
                del runs[name]
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(ROUNDS):
            for name, run in runs.items():
                with _layout(module, name == "channels_last"):
                    times[name].append(_timed(module if isinstance(run, str) else run, example, autocast))
    # Every replica sends a time for every candidate it tried (inf where its own check refused
    # one), so the all-reduce has one shape everywhere and a refusal anywhere drops it everywhere.
    tried = {name: statistics.median(times[name]) if name in times else math.inf for name in tried_names}
    plan.seconds = {name: t for name, t in _agreed(tried).items() if math.isfinite(t)}
    for name in tried_names:
        if name not in plan.seconds:
            plan.rejected.setdefault(name, "computes differently on another replica, not kept")
    best = min(plan.seconds, key=plan.seconds.get)
    if best != "eager" and plan.seconds["eager"] / plan.seconds[best] >= MIN_GAIN:
        setattr(plan, best, True)
    for name in plan.seconds:
        if name not in ("eager", plan.name):
            plan.rejected.setdefault(name, f"{plan.seconds['eager'] / plan.seconds[name]:.2f}x eager, not kept")
    return plan


def apply_layout(module: nn.Module, plan: FastPath) -> None:
    """Convert the parameters in place (the optimizer keeps the same ``Parameter`` objects)."""
    if plan.channels_last:
        module.to(memory_format=torch.channels_last)


def _run(module: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> torch.Tensor:
    with autocast():
        out = module(example)
    return out.float()


def _grads(module: nn.Module, run: nn.Module, example: torch.Tensor, autocast: Callable[[], Any]) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    out = _run(run, example, autocast)
    out.sum().backward()
    return [out.detach()] + [p.grad.clone() if p.grad is not None else torch.zeros(()) for p in module.parameters()]


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
def _layout(module: nn.Module, channels_last: bool) -> Iterator[None]:
    if not channels_last:
        yield
        return
    module.to(memory_format=torch.channels_last)
    try:
        yield
    finally:
        module.to(memory_format=torch.contiguous_format)


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

