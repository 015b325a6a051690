"""Cut a model into pipeline stages without rewriting it.

Two shapes of model are split, as they are:

- an ``nn.Sequential``: its children are the layers, and a stage runs a contiguous run of them;
- a model whose ``forward`` runs an ``nn.ModuleList`` of blocks one after another
  (``for block in self.blocks: x = block(x)``), or calls an ``nn.Sequential`` of them, at any
  depth (nanoGPT's ``transformer.h``, a ModuleList in a ModuleDict): the blocks are the layers.
  The modules registered before the container, at each level of its path (embeddings), belong
  to the first stage, those after it (final norm, head) to the last. Parameters and buffers
  held directly by the model, or by a container on that path (``transformer`` itself), belong
  to the first stage. Names stay the model's, so checkpoints keep its keys.

The first stage runs the model's own ``forward`` with the list cut to its blocks, and stops
at the end of the last one. Middle stages run their blocks. The last stage runs ``forward``
again with the list starting at its blocks, fed the received activation; the code before
the blocks runs there on meta tensors (shapes only), so its weights need not be present.
Stages are balanced by parameter count, by measured time, or cut at named blocks.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from loom.compat import child_names
from loom.strategies.outputs import map_outputs
from loom.strategies.data_parallel.sync_batchnorm import first_batchnorm


@dataclass(frozen=True)
class Layers:
    """Where a model's layers are: its blocks, and what runs before and after them."""

    model: nn.Module
    names: list[str]  # the layers' full names: "0", "1" (Sequential) or "blocks.0", "blocks.1"
    list_name: str | None  # the blocks' container by its dotted path ("transformer.h"); None for a Sequential model
    before: list[str]  # children registered before the list (first stage)
    after: list[str]  # children registered after it (last stage)

    def module(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def own(self) -> dict[str, torch.Tensor]:
        """The first stage's tensors outside any module it runs (see ``path_tensors``)."""
        return path_tensors(self.model, self.list_name)

    def stage_names(self, bounds: Sequence[int], stage: int) -> list[str]:
        """Top-level names (and layer names) a stage owns: what it holds and what it saves."""
        first, last = stage == 0, stage == len(bounds) - 2
        names = self.names[bounds[stage] : bounds[stage + 1]]
        return (self.before if first else []) + names + (self.after if last else [])


def find_layers(model: nn.Module, split_points: Sequence[str] | None = None) -> Layers:
    """The layers of an ``nn.Sequential``, or the blocks of the model's largest ``nn.ModuleList`` or
    ``nn.Sequential`` at any depth (``transformer.h``); with ``split_points``, of the one they name."""
    if split_points:
        list_name = split_points[0].rpartition(".")[0]
        container = _container_at(model, list_name, split_points[0])
    elif isinstance(model, nn.Sequential):
        list_name, container = "", model
    else:
        lists = [(name, m) for name, m in model.named_modules() if name and isinstance(m, (nn.ModuleList, nn.Sequential))]
        if not lists:
            raise ValueError(
                f"PipelineStrategy splits an nn.Sequential, or a model whose forward runs an nn.ModuleList of blocks; "
                f"{type(model).__name__} has neither: keep its blocks in an nn.ModuleList attribute"
            )
        list_name, container = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    names = [f"{list_name}.{child}" if list_name else child for child, _ in container.named_children()]
    if not list_name:
        return Layers(model, names, None, [], [])
    held = [f"{list_name}.{n}" for n, _ in [*container.named_parameters(recurse=False), *container.named_buffers(recurse=False)]]
    if held:
        raise ValueError(
            f"PipelineStrategy cannot split {list_name}: it holds {', '.join(held)} itself, outside its blocks, where "
            "no stage runs it; register it on the module that holds the blocks, or on a block"
        )
    before, after = _around(model, list_name)
    return Layers(model, names, list_name, before, after)


def _container_at(model: nn.Module, path: str, point: str) -> nn.Module:
    """The ModuleList or Sequential a split point is a block of."""
    try:
        container = model.get_submodule(path)
    except AttributeError:
        container = None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise ValueError(
            f"split point {point!r} is no block of an nn.ModuleList or nn.Sequential of {type(model).__name__}: "
            "name blocks by their path in the model (\"transformer.h.2\")"
        )
    return container


def _around(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """The modules registered before and after ``path``, at every level of it, by their full names."""
    before: list[str] = []
    after: list[str] = []
    parent, prefix = model, ""
    for part in path.split("."):
        children = child_names(parent)
        at = children.index(part)
        before += [prefix + name for name in children[:at]]
        after = [prefix + name for name in children[at + 1 :]] + after
        parent, prefix = parent.get_submodule(part), f"{prefix}{part}."
    return before, after


def parameter_costs(layers: Layers) -> list[float]:
    """Parameters per layer; the first and last carry the modules that run before and after the blocks."""
    count = lambda names: sum(p.numel() for n in names for p in layers.module(n).parameters())  # noqa: E731
    costs = [float(count([name])) for name in layers.names]
    own = sum(t.numel() for t in layers.own().values() if isinstance(t, nn.Parameter))
    costs[0] += count(layers.before) + own
    costs[-1] += count(layers.after)
    return costs


def time_costs(layers: Layers, example: Any, repeats: int = 3) -> list[float]:
    """Seconds of forward plus backward per layer, measured on ``example`` (median of ``repeats``).

    Time before the first layer and after the last is added to those layers, like their weights.
    """
    marks: list[tuple[str, int, float]] = []
    hooks = []
    for i, name in enumerate(layers.names):
        module = layers.module(name)
        hooks += [
            module.register_forward_pre_hook(lambda *_, i=i: marks.append(("f0", i, time.perf_counter()))),
            module.register_forward_hook(lambda *_, i=i: marks.append(("f1", i, time.perf_counter()))),
            module.register_full_backward_pre_hook(lambda *_, i=i: marks.append(("b0", i, time.perf_counter()))),
            module.register_full_backward_hook(lambda *_, i=i: marks.append(("b1", i, time.perf_counter()))),
        ]
    runs = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the first layer's inputs need no grad
            for _ in range(repeats + 1):  # the first run warms up
                marks.clear()
                start = time.perf_counter()
                out = layers.model(example)
                forward_end = time.perf_counter()
                tensors_in(out)[0].float().sum().backward()
                end = time.perf_counter()
                runs.append(_per_layer(marks, len(layers.names), start, forward_end, end))
    finally:
        for hook in hooks:
            hook.remove()
        layers.model.zero_grad(set_to_none=True)
    per_layer = list(zip(*runs[1:]))
    return [sorted(samples)[len(samples) // 2] for samples in per_layer]


def _per_layer(marks: list[tuple[str, int, float]], n: int, start: float, forward_end: float, end: float) -> list[float]:
    at = {(kind, i): t for kind, i, t in marks}
    costs = [at[("f1", i)] - at[("f0", i)] + at.get(("b1", i), 0.0) - at.get(("b0", i), 0.0) for i in range(n)]
    costs[0] += at[("f0", 0)] - start + end - at.get(("b1", 0), end)  # before the blocks, both ways
    costs[-1] += forward_end - at[("f1", n - 1)] + at.get(("b0", n - 1), forward_end) - forward_end
    return costs


def balanced_bounds(costs: Sequence[float], stages: int) -> list[int]:
    """Cut ``costs`` into ``stages`` contiguous runs minimising the largest run's total.

    Returns the ``stages + 1`` bounds: stage s holds layers ``bounds[s]:bounds[s+1]``.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest largest-run over the first i layers in k runs, and where run k starts
    inf = float("inf")
    best = [[(inf, 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            best[k][i] = min(((max(best[k - 1][j][0], prefix[i] - prefix[j]), j) for j in range(k - 1, i)), key=lambda t: t[0])
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(best[k][bounds[-1]][1])
    return bounds[::-1]


def split_bounds(layers: Layers, stages: int, split_points: Sequence[str] | None = None, costs: Sequence[float] | None = None) -> list[int]:
    """The bounds of ``stages`` stages: at the named layers, else balanced by ``costs`` (default: parameters)."""
    n = len(layers.names)
    if stages > n:
        raise ValueError(
            f"PipelineStrategy cannot cut {type(layers.model).__name__} into {stages} stages: it has {n} layers "
            f"({', '.join(layers.names)}); use at most {n} stages"
        )
    if split_points is None:
        return balanced_bounds(list(costs) if costs is not None else parameter_costs(layers), stages)
    points = list(split_points)
    for point in points:
        if point not in layers.names:
            raise ValueError(
                f"split point {point!r} names no layer of {type(layers.model).__name__}; stages start at one of: "
                f"{', '.join(layers.names[1:])}"
            )
    bounds = [0, *(layers.names.index(p) for p in points), n]
    if len(points) != stages - 1 or bounds != sorted(set(bounds)):
        raise ValueError(
            f"PipelineStrategy(stages={stages}) needs {stages - 1} split point(s), each a later layer than the one "
            f"before and none the first, got {points}"
        )
    return bounds


def describe(layers: Layers, bounds: Sequence[int]) -> str:
    """One line: each stage's modules and parameter count."""
    parts = []
    for s in range(len(bounds) - 1):
        names = layers.stage_names(bounds, s)
        count = sum(p.numel() for n in names for p in layers.module(n).parameters())
        if s == 0:
            count += sum(t.numel() for t in layers.own().values() if isinstance(t, nn.Parameter))
        parts.append(f"stage {s}: {_ranges(names)} ({count:,} params)")
    return "pipeline split: " + "; ".join(parts)


def _ranges(names: list[str]) -> str:
    """``blocks.0, blocks.1, blocks.2`` as ``blocks.0-2``."""
    out: list[str] = []
    run: list[str] = []
    for name in names + [""]:
        prefix, _, index = name.rpartition(".")
        if run and index.isdigit() and run[-1].rpartition(".")[0] == prefix and int(run[-1].rpartition(".")[2]) + 1 == int(index):
            run.append(name)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1].rpartition('.')[2]}")
        run = [name] if name.rpartition(".")[2].isdigit() else []
        if name and not run:
            out.append(name)
    return ", ".join(out)


# ---- the stage modules ----------------------------------------------------------------------
class _Stop(Exception):
    """Ends the first stage's forward at the end of its last block, carrying the activation."""

    def __init__(self, activation: torch.Tensor) -> None:
        super().__init__()
        self.activation = activation


class _StopHere(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise _Stop(x)


class _Feed(nn.Module):
    """Stands where the earlier stages' blocks were: hands on the activation they produced."""

    def __init__(self) -> None:
        super().__init__()
        self.activation: torch.Tensor | None = None

    def forward(self, _ignored: Any) -> torch.Tensor:
        assert self.activation is not None
        return self.activation


class SequentialStage(nn.Module):
    """A run of layers (a middle stage, or any stage of an nn.Sequential)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(modules)

    def forward(self, x: Any, *targets: Any) -> Any:
        for layer in self.layers:  # targets: a whole model in one stage that computes its own loss
            x = layer(x, *targets)
        return x


class _ForwardStage(nn.Module):
    """Runs the model's own forward with its block list replaced for the duration of one call."""

    def __init__(self, layers: Layers, blocks: list[nn.Module], outer: list[str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        # Registered so that the stage's parameters are its own (zero-bubble schedules compute their
        # weight gradients from them); the model is not a submodule: the stage owns only its part.
        self.outer = nn.ModuleList(layers.module(name) for name in outer)
        object.__setattr__(self, "model", layers.model)
        self.list_name = layers.list_name
        self.before = layers.before

    def _with_list(self, modules: list[nn.Module], call: Callable[[], Any]) -> Any:
        path, _, name = self.list_name.rpartition(".")
        parent = self.model.get_submodule(path)
        original = parent.get_submodule(name)
        parent.register_module(name, nn.Sequential(*modules) if isinstance(original, nn.Sequential) else nn.ModuleList(modules))
        try:
            return call()
        finally:
            parent.register_module(name, original)


class FirstStage(_ForwardStage):
    """The model's forward up to the end of this stage's last block."""

    def forward(self, inputs: Any, *targets: Any) -> torch.Tensor:
        try:
            self._with_list([*self.blocks, _StopHere()], lambda: self.model(inputs, *targets))
        except _Stop as stop:
            return stop.activation
        raise RuntimeError(
            f"{type(self.model).__name__}.forward did not run its {self.list_name} one after another "
            "(for block in self.blocks: x = block(x)), so it cannot be split there: pass split points of an "
            "nn.Sequential instead"
        )


class LastStage(_ForwardStage):
    """The model's forward from this stage's first block to the end, fed the received activation.

    The code before the blocks runs on meta tensors of ``example``'s shapes (set before each
    step: one micro-batch of inputs), with meta weights, so only shapes are computed.
    """

    example: Any = None

    def forward(self, activation: torch.Tensor, *targets: Any) -> Any:
        """``targets``, for a model that computes its own loss, are real: the loss is computed here."""
        from torch.func import functional_call  # torch.func imports functorch: only where a stage runs

        feed = _Feed()
        feed.activation = activation
        early = {**_named_tensors(self.model, self.before), **path_tensors(self.model, self.list_name)}
        meta = {name: torch.empty_like(t, device="meta") for name, t in early.items()}
        out = self._with_list([feed, *self.blocks], lambda: functional_call(self.model, meta, (to_meta(self.example), *targets), strict=False))
        if any(t.is_meta for t in tensors_in(out)):
            raise RuntimeError(
                f"{type(self.model).__name__}.forward uses, after its {self.list_name}, a value computed before them, "
                "which a later pipeline stage does not have: make the model an nn.Sequential, or pass it to the blocks"
            )
        return out


def _named_tensors(model: nn.Module, children: list[str]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for child in children:
        module = model.get_submodule(child)
        found.update({f"{child}.{n}": t for n, t in [*module.named_parameters(), *module.named_buffers()]})
    return found


def path_tensors(model: nn.Module, list_name: str | None) -> dict[str, torch.Tensor]:
    """Tensors held directly by the model and by each container on the path to its blocks (a
    parameter of ``transformer`` itself), by their names in the model's state dict."""
    parts = (list_name or "").split(".")
    paths = [".".join(parts[:depth]) for depth in range(len(parts))]  # "transformer.h": "", "transformer"
    found: dict[str, torch.Tensor] = {}
    for path in paths:
        module = model.get_submodule(path)
        found.update({f"{path}.{n}" if path else n: t for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]})
    return found


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of an output, in the order ``map_outputs`` walks it (dataclasses and dict subclasses included)."""
    found: list[torch.Tensor] = []
    map_outputs(lambda v: found.append(v) if isinstance(v, torch.Tensor) else None, tree)
    return found


def to_meta(tree: Any) -> Any:
    """The same structure, of the same classes, with every tensor a meta tensor of its shape and dtype."""
    return map_outputs(lambda v: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v, tree)


def build_stage(layers: Layers, bounds: Sequence[int], stage: int) -> nn.Module:
    """The module stage ``stage`` runs: it shares its parameters with the model."""
    blocks = [layers.module(n) for n in layers.names[bounds[stage] : bounds[stage + 1]]]
    first, last = stage == 0, stage == len(bounds) - 2
    if layers.list_name is None or not (first or last):
        return SequentialStage(blocks)
    if first and last:
        return SequentialStage([layers.model])
    if first:
        stage_module = FirstStage(layers, blocks, layers.before)
        for name, tensor in layers.own().items():
            if isinstance(tensor, nn.Parameter):
                stage_module.register_parameter("model_" + name.replace(".", "_"), tensor)
        return stage_module
    return LastStage(layers, blocks, layers.after)


def check_untied(layers: Layers, bounds: Sequence[int]) -> None:
    """A parameter used by two stages would be two copies trained apart: refuse it."""
    seen: dict[int, tuple[int, str]] = {}
    for s in range(len(bounds) - 1):
        for name, tensor in owned_tensors(layers, bounds, [s]).items():
            first = seen.setdefault(id(tensor), (s, name))
            if first[0] != s:
                raise ValueError(
                    f"{first[1]} (stage {first[0]}) and {name} (stage {s}) are one tied parameter, which two stages "
                    "would train as two copies: untie them, or keep both modules in one stage with split_points"
                )


def refuse_batchnorm(model: nn.Module) -> None:
    """BatchNorm in a pipeline would normalise each micro-batch by its own statistics: refuse it."""
    if (name := first_batchnorm(model)) is not None:
        raise ValueError(
            f"PipelineStrategy cannot train BatchNorm layer '{name}' as one device does: each micro-batch would be "
            "normalised by its own statistics, and update the running ones once per micro-batch; use GroupNorm or "
            "LayerNorm there, or MirroredStrategy(sync_batchnorm=True)"
        )


def owned_tensors(layers: Layers, bounds: Sequence[int], stages: Sequence[int]) -> dict[str, torch.Tensor]:
    """The parameters and buffers of ``stages``, by their full names in the model."""
    owned: dict[str, torch.Tensor] = {}
    for s in stages:
        for name in layers.stage_names(bounds, s):
            module = layers.module(name)
            owned.update({f"{name}.{n}": t for n, t in [*module.named_parameters(), *module.named_buffers()]})
        if s == 0:
            owned.update(layers.own())
    return owned
