"""``loom.advise``: which strategy to choose for a model, from facts measured on it.

The seeds' guidance made executable: all-reduce for dense models on fast links, parameter
servers for sparse models whose batches touch few embedding rows, sharding or a pipeline when
the model's training state does not fit one device. Each candidate gets the bytes it moves per
step (per replica) and an expected step time from a small cost model:

- data parallel: ring all-reduce of the gradients, ``2 (n-1)/n`` of their bytes, overlapped
  with the backward pass (two thirds of the compute); compression halves the bytes;
- parameter servers: each worker pulls and pushes its dense parameters and the embedding rows
  its batch touches, not overlapped;
- sharded (ZeRO-3): parameters all-gathered twice and gradients reduce-scattered,
  ``3 (n-1)/n`` of the parameter bytes, overlapped with the compute;
- pipeline: the global batch's activations and their gradients cross each stage boundary;
  the schedule's bubble with ``4n`` micro-batches adds ``(n-1)/4n`` of the compute;
- one device: the global batch on one device, ``n`` times the compute.

Model parallelism (sharded, pipeline, hybrid) is for a model whose training state does not fit
one device: it is chosen only when no replicated option fits. Options within a tenth of the
fastest go to the simplest (the order of ``CANDIDATES``).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from loom.diagnostics.breakdown import batch_size_of
from loom.diagnostics.verdict import size

ASSUMED_LINK_GBPS = 10.0  # when the link is neither given nor measurable: ordinary datacenter Ethernet
OVERLAP = 2 / 3  # share of the compute that is the backward pass, behind which an all-reduce hides
USABLE_MEMORY = 0.9
SIMPLER_WITHIN = 1.10
CANDIDATES = ("OneDevice", "Mirrored", "Mirrored+compression", "ParameterServer", "Sharded", "Pipeline", "Hybrid")
REPLICATED = 4  # the first four hold the whole model on every device


@dataclass
class Facts:
    """What the recommendation rests on; every byte count is for the whole model unless named per-something."""

    parameter_bytes: int
    embedding_bytes: int
    embedding_rows: int
    rows_touched: float  # share of embedding rows one replica's batch touches
    activation_bytes_per_sample: float
    boundary_bytes_per_sample: float  # the largest output of a top-level layer: what crosses a pipeline cut
    batch_size: int  # one replica's batch (the sample batch)
    device_memory: int
    link_bytes_per_sec: float
    link_source: str  # measured, given or assumed
    compute_seconds: float  # forward and backward of the sample batch on one device
    compute_source: str  # measured or given
    replicas: int
    nodes: int
    optimizer_slots: int  # tensors the optimizer keeps per parameter (Adam: 2, SGD with momentum: 1)


@dataclass
class Option:
    strategy: str
    bytes_per_step: float  # sent by each replica per step
    step_seconds: float
    memory_per_device: float
    fits: bool


@dataclass
class Advice:
    recommendation: str
    options: list[Option]
    facts: Facts
    reasons: str
    current: str | None = None  # the strategy in use, when given

    def __str__(self) -> str:
        lines = [f"recommended: {self.recommendation}", f"{'strategy':<44}{'MB/step':>10}{'step ms':>10}{'GB/device':>11}  fits"]
        for o in self.options:
            lines.append(
                f"{o.strategy:<44}{o.bytes_per_step / 1e6:>10.2f}{o.step_seconds * 1e3:>10.1f}"
                f"{o.memory_per_device / 1e9:>11.3f}  {'yes' if o.fits else 'no'}"
            )
        return "\n".join(lines + [self.reasons])


def advise(
    model: nn.Module,
    sample_batch: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    replicas: int | None = None,
    nodes: int | None = None,
    device: torch.device | str | None = None,
    device_memory: int | None = None,
    link_gbps: float | None = None,
    compute_seconds: float | None = None,
    optimizer_slots: int = 2,
    strategy: Any = None,
) -> Advice:
    """Recommend a strategy for training ``model`` on ``replicas`` devices over ``nodes`` machines.

    ``sample_batch`` is one replica's input (``model(sample_batch)``, or a tuple of arguments);
    ``loss_fn(outputs)`` makes the loss (default: the sum of the outputs). One forward pass in
    eval mode measures the activations saved for backward and the embedding rows touched (no
    gradient is computed); a copy of the model times forward and backward unless
    ``compute_seconds`` is given. ``device_memory`` defaults to the device's: pass it, and
    ``compute_seconds``, to plan for other hardware. The link's bandwidth is measured with an
    all-reduce when ``strategy`` spans several replicas (then call this on every replica),
    else taken from ``link_gbps`` (Gbit/s), else assumed (10 Gbit/s, said so in the reasons).
    ``strategy`` is also the one in use: the reasons say when it is not the recommended one.
    """
    cluster = getattr(strategy, "cluster", None)
    nodes = nodes or getattr(cluster, "nnodes", 1)
    replicas = replicas or (strategy.num_replicas_in_sync if strategy is not None else max(torch.cuda.device_count(), 1))
    if nodes < 1 or replicas < nodes:
        raise ValueError(f"advise() needs replicas >= nodes >= 1, got replicas={replicas}, nodes={nodes}")
    if optimizer_slots < 0:
        raise ValueError(f"advise() takes optimizer_slots of 0 or more, got {optimizer_slots}")
    device = torch.device(device) if device is not None else (strategy.device if strategy is not None else torch.device("cpu"))
    facts = measure(model, sample_batch, loss_fn, device, compute_seconds)
    facts.nodes, facts.replicas, facts.optimizer_slots = nodes, replicas, optimizer_slots
    facts.device_memory = device_memory or _device_memory(device)
    measured = _measured_link(strategy, facts.parameter_bytes)
    if measured:
        facts.link_bytes_per_sec, facts.link_source = measured, "measured"
    elif link_gbps is not None:
        facts.link_bytes_per_sec, facts.link_source = link_gbps * 1e9 / 8, "given"
    return recommend(facts, current=describe(strategy) if strategy is not None else None)


def describe(strategy: Any) -> str:
    """A strategy as ``recommend`` names it."""
    name = type(strategy).__name__
    compression = getattr(strategy, "compression", None)
    return f"{name}(compression='{compression}')" if compression else name


def measure(
    model: nn.Module, sample_batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None, device: torch.device,
    compute_seconds: float | None = None,
) -> Facts:
    """The model's own facts; its parameters, gradients and buffers stay as they were."""
    args = sample_batch if isinstance(sample_batch, tuple) else (sample_batch,)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    batch = _batch_size(args)
    params = [p for p in model.parameters() if p.requires_grad]
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    touched: dict[int, set[int]] = {id(m): set() for m in tables}
    hooks = [m.register_forward_pre_hook(_row_counter(touched[id(m)])) for m in tables]
    boundaries: list[int] = []
    hooks += [c.register_forward_hook(lambda _m, _a, out: boundaries.append(_bytes(out))) for c in model.children()]
    saved = _SavedBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
    was_training = model.training
    model.eval()  # BatchNorm's running statistics stay as they are
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
            model(*args)  # the graph is dropped unused: no gradient is computed
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    rows = sum(m.num_embeddings for m in tables)
    return Facts(
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        embedding_bytes=sum(m.weight.numel() * m.weight.element_size() for m in tables if m.weight.requires_grad),
        embedding_rows=rows,
        rows_touched=sum(len(s) for s in touched.values()) / rows if rows else 0.0,
        activation_bytes_per_sample=saved.bytes / batch,
        boundary_bytes_per_sample=max(boundaries, default=0) / batch,
        batch_size=batch,
        device_memory=0,
        link_bytes_per_sec=ASSUMED_LINK_GBPS * 1e9 / 8,
        link_source="assumed",
        compute_seconds=compute_seconds if compute_seconds is not None else _time_step(model, args, loss_fn, device),
        compute_source="given" if compute_seconds is not None else "measured",
        replicas=1,
        nodes=1,
        optimizer_slots=2,
    )


def _time_step(model: nn.Module, args: tuple, loss_fn: Callable[[Any], torch.Tensor] | None, device: torch.device) -> float:
    """Forward and backward on a copy of the model, the median of three after a warm-up."""
    probe = copy.deepcopy(model).train()
    seconds = []
    for i in range(4):
        probe.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        _loss(probe(*args), loss_fn).backward()
        _sync(device)
        if i:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def recommend(facts: Facts, current: str | None = None) -> Advice:
    """Cost every candidate on ``facts`` and pick: the fastest that fits, or the simplest near it."""
    costed = [(i, _option(name, facts)) for i, name in enumerate(CANDIDATES)]
    options = [o for _, o in costed if o is not None]
    replicated = [o for i, o in costed if o is not None and o.fits and i < REPLICATED]
    feasible = replicated or [o for o in options if o.fits]
    if not feasible:
        best = min(options, key=lambda o: o.memory_per_device)
    else:
        fastest = min(o.step_seconds for o in feasible)
        best = next(o for o in feasible if o.step_seconds <= SIMPLER_WITHIN * fastest)
    return Advice(best.strategy, options, facts, _reasons(best, options, facts, current), current)


def _names(facts: Facts) -> dict[str, str]:
    data_parallel = "MirroredStrategy" if facts.nodes == 1 else "MultiWorkerMirroredStrategy"
    return {
        "OneDevice": "OneDeviceStrategy",
        "Mirrored": data_parallel,
        "Mirrored+compression": f"{data_parallel}(compression='bf16')",
        "ParameterServer": "ParameterServerStrategy",
        "Sharded": "ShardedStrategy",
        "Pipeline": "PipelineStrategy",
        "Hybrid": "HybridStrategy",
    }


def _option(name: str, f: Facts) -> Option | None:
    n, c, bw = f.replicas, f.compute_seconds, f.link_bytes_per_sec
    if name != "OneDevice" and n < 2 or name == "Hybrid" and f.nodes < 2:
        return None
    state = f.parameter_bytes * (2 + f.optimizer_slots)  # parameters, gradients, optimizer slots
    activations = f.activation_bytes_per_sample * f.batch_size
    if name == "OneDevice":
        sent, seconds, memory = 0.0, n * c, state + n * activations
    elif name in ("Mirrored", "Mirrored+compression"):
        sent = 2 * (n - 1) / n * f.parameter_bytes * (0.5 if name == "Mirrored+compression" else 1.0)
        seconds, memory = c + max(0.0, sent / bw - OVERLAP * c), state + activations
    elif name == "ParameterServer":
        dense = f.parameter_bytes - f.embedding_bytes
        sent = 2 * (dense + f.rows_touched * f.embedding_bytes)
        seconds = c + sent / bw
        memory = dense * (2 + f.optimizer_slots) + 2 * f.rows_touched * f.embedding_bytes + activations
    elif name == "Sharded":
        sent = 3 * (n - 1) / n * f.parameter_bytes
        seconds, memory = c + max(0.0, sent / bw - c), state / n + activations
    elif name == "Pipeline":
        sent = 2 * f.boundary_bytes_per_sample * f.batch_size * n
        seconds, memory = c * (1 + (n - 1) / (4 * n)) + sent / bw, state / n + activations
    else:  # Hybrid: sharded within each machine, gradients all-reduced across machines
        local = n // f.nodes
        sent = 2 * (f.nodes - 1) / f.nodes * f.parameter_bytes / local
        seconds, memory = c + max(0.0, sent / bw - OVERLAP * c), state / local + activations
    return Option(_names(f)[name], sent, seconds, memory, memory <= USABLE_MEMORY * f.device_memory)


def _reasons(best: Option, options: list[Option], f: Facts, current: str | None) -> str:
    by_name = {o.strategy: o for o in options}
    names = _names(f)
    state = f.parameter_bytes * (2 + f.optimizer_slots)
    words = [
        f"The model has {size(f.parameter_bytes)} of parameters ({size(state)} with gradients and "
        f"{f.optimizer_slots} optimizer slot(s)) and saves {size(f.activation_bytes_per_sample)} of activations "
        f"per sample; a device has {size(f.device_memory)}."
    ]
    if f.embedding_rows:
        words.append(
            f"Embedding tables hold {f.embedding_bytes / max(f.parameter_bytes, 1):.1%} of the parameters "
            f"({f.embedding_rows:,} rows) and a batch of {f.batch_size} touches {f.rows_touched:.3%} of the rows."
        )
    words.append(
        f"On {f.replicas} device(s) over {f.nodes} machine(s), with a {f.link_source} link of "
        f"{f.link_bytes_per_sec * 8 / 1e9:,.2f} Gbit/s and a {f.compute_source} compute time of "
        f"{f.compute_seconds * 1e3:,.1f} ms per batch, {best.strategy} is expected to take {best.step_seconds * 1e3:,.1f} ms "
        f"a step moving {size(best.bytes_per_step)} per replica"
    )
    plain = by_name.get(names["Mirrored"])
    if plain is not None and best is not plain:
        why = "does not fit" if not plain.fits else f"would take {plain.step_seconds * 1e3:,.1f} ms"
        words[-1] += f", where {plain.strategy} moves {size(plain.bytes_per_step)} and {why}"
    words[-1] += "."
    if not best.fits:
        words.append("Nothing fits: add devices, shrink the batch, or keep fewer optimizer slots.")
    if current is not None and best.strategy != current:
        words.append(f"The job runs {current}.")
    return " ".join(words)


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward, each storage once, parameters left out."""

    def __init__(self, parameters: set[int]) -> None:
        self.seen = set(parameters)
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor


def _row_counter(rows: set[int]) -> Callable[..., None]:
    def count(module: nn.Module, args: tuple) -> None:
        rows.update(torch.unique(args[0]).tolist())

    return count


def _bytes(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, (list, tuple)):
        return sum(_bytes(o) for o in out)
    if isinstance(out, dict):
        return sum(_bytes(o) for o in out.values())
    return 0


def _loss(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(out)
    tensors = [out] if isinstance(out, torch.Tensor) else list(out.values()) if isinstance(out, dict) else list(out)
    return sum(t.float().sum() for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad)


def _batch_size(args: tuple) -> int:
    size = batch_size_of(args)
    if not size:
        raise TypeError("advise() needs a sample batch with a batch dimension: a tensor, or a tuple of the model's arguments")
    return size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _measured_link(strategy: Any, size: int) -> float | None:
    if strategy is None or strategy.num_replicas_in_sync < 2:
        return None
    from loom.diagnostics.report import bandwidth

    return bandwidth(strategy, size)
