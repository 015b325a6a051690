"""Tensor parallelism on DTensor: every process holds a slice of each split layer's weights.

A Linear pair is split column-wise, then row-wise: the first layer's output features (an
MLP's hidden units, attention's heads) are divided between the processes, each computes
its slice, and the second layer's partial sums are all-reduced, once per pair. Embeddings
are split by rows (the vocabulary) and the output layer by columns, its logits gathered so
the loss sees them whole. Layers the plan does not name stay whole on every process.

Every process of the tensor-parallel group reads the same batch, so one group is one
replica. Equal to one device up to float reassociation: a row-wise layer adds its partial
sums in another order than one matmul does (about 1e-7 relative in fp32).

At ``prepare`` every process takes rank 0's values, so a script that seeds each rank
differently still trains one model. A weight tied between two layers (a GPT's embedding
and output layer) stays one weight: both sides are split alike or both stay whole. A model
compiled before ``prepare`` is split under its own layer names.
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Iterator, Mapping, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from loom.compat import compiled_module_type, compiled_original
from loom.strategies.model_parallel.dtensor_norm import clip_grad_norm
from loom.strategies.model_parallel.mesh import MeshStrategy, broadcast_states
from loom.strategies.precision import canonical

# The styles a plan names. "output" is column-wise with its outputs gathered (a model's last
# layer, whose logits the loss needs whole); "embedding" splits an nn.Embedding's rows.
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
}
Plan = Mapping[str, Union[str, ParallelStyle]]

# Names of the common transformer layouts (GPT-2, Llama, BERT, nanoGPT): the first side of a
# pair is split by columns, the second by rows.
COLWISE_NAMES = {"q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
                 "fc", "fc1", "c_fc", "w1", "w3", "gate_proj", "up_proj", "up"}  # fmt: skip
ROWWISE_NAMES = {"proj", "o_proj", "out_proj", "wo", "c_proj", "fc2", "w2", "down_proj", "down", "dense"}
OUTPUT_NAMES = {"head", "lm_head", "output"}


class TensorParallelStrategy(MeshStrategy):
    """Every process holds a slice of each split layer; all of them together are one replica.

    Args:
        plan: module name (``fnmatch`` patterns allowed, e.g. ``"blocks.*.mlp.fc"``) to style:
            ``"colwise"``, ``"rowwise"``, ``"output"``, ``"embedding"``, or a torch
            ``ParallelStyle``. Default: ``default_plan(model, degree)``.
        precision, timeout, backend: as for ``MirroredStrategy``.

    The model must not hard-code sizes that the split divides: attention must reshape to
    ``(batch, time, -1, head_dim)``, as each process holds ``heads / degree`` heads.
    ``torch.compile`` works before or after ``prepare``; where the sequence length changes
    between calls, pass it ``dynamic=False``: torch's tracer fails on a split layer whose input
    has a symbolic length (torch 2.13, a RecursionError in the backward's trace).
    """

    def __init__(
        self, plan: Plan | None = None, precision: str = "32", timeout: float | None = None, backend: str | None = None
    ) -> None:
        if canonical(precision) == "16-mixed":
            raise ValueError(
                "TensorParallelStrategy cannot skip an fp16 step that overflowed on one process's slice only: "
                "use precision='bf16-mixed', which needs no loss scaling"
            )
        super().__init__({"tp": -1}, precision=precision, timeout=timeout, backend=backend)
        self.plan = plan

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        broadcast_states(module, self.device)  # the layers the plan leaves whole start equal on every process
        tensor_parallelize(uncompiled(module), self.device_mesh, self.plan)
        return module

    def _clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return clip_grad_norm(params, max_norm, norm_type)


def tensor_parallelize(module: nn.Module, mesh: DeviceMesh, plan: Plan | None = None) -> nn.Module:
    """Split ``module``'s layers over ``mesh`` (1-D, or the ``"tp"`` dimension of a larger one), in place."""
    if mesh.ndim > 1:
        mesh = mesh["tp"]
    plan = default_plan(module, mesh.size()) if plan is None else plan
    ties = tied_weights(module)
    parallelize_module(module, mesh, resolve_plan(module, plan))
    _tie_again(module, ties)
    return module


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (compilation happens at the first call, so after the split)."""
    compiled = compiled_module_type()
    return compiled_original(module) if compiled is not None and isinstance(module, compiled) else module


def tied_weights(module: nn.Module) -> list[list[str]]:
    """The full names of each parameter that several modules share (a GPT's ``embed.weight`` and ``head.weight``)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tie_again(module: nn.Module, ties: list[list[str]]) -> None:
    """Share each tied parameter again after ``parallelize_module`` gave each side its own; refuse sides split unlike."""
    for names in ties:
        params = [module.get_parameter(name) for name in names]
        layouts = [tuple(p.placements) if isinstance(p, DTensor) else "whole" for p in params]
        if len(set(layouts)) > 1:
            sides = " and ".join(f"{name} ({_layout(layout)})" for name, layout in zip(names, layouts))
            raise ValueError(
                f"the tensor-parallel plan splits the tied weights {sides} unlike, which would untie them: split both "
                "sides alike (an embedding as 'embedding' with its output layer as 'output') or leave both out of the plan"
            )
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(owner), attribute, params[0])


def _layout(layout: Union[str, tuple]) -> str:
    return layout if isinstance(layout, str) else ", ".join(f"split on dim {p.dim}" if isinstance(p, Shard) else str(p) for p in layout)


def resolve_plan(module: nn.Module, plan: Plan) -> dict[str, ParallelStyle]:
    """``plan``'s styles as torch's objects, after checking that every name matches a layer."""
    layers = dict(module.named_modules())
    styles = {}
    for name, style in plan.items():
        matched = [n for n in layers if fnmatch(n, name)] if any(c in name for c in "*?[") else [name] * (name in layers)
        if not matched:
            close = [n for n, m in layers.items() if isinstance(m, (nn.Linear, nn.Embedding))][:6]
            raise ValueError(
                f"the tensor-parallel plan names {name!r}, which is not a module of {type(module).__name__}; "
                f"name its layers as named_modules() does, e.g. {', '.join(close) or 'none'}"
            )
        if isinstance(style, ParallelStyle):
            styles[name] = style
        elif style in STYLES:
            styles[name] = STYLES[style]()
        else:
            raise ValueError(f"unknown tensor-parallel style {style!r} for {name!r}; choose one of: {', '.join(STYLES)}")
    named = {n: style for pattern, style in plan.items() for n in layers if n == pattern or fnmatch(n, pattern)}
    check_partners(module, named)
    check_pairs(module, named)
    return styles


def check_partners(module: nn.Module, plan: Mapping[str, Union[str, ParallelStyle]]) -> None:
    """Refuse a column-wise layer with no row-wise layer after it, or a row-wise one with no column-wise before it.

    A column-wise layer's output stays split over the processes: only a row-wise layer takes
    it (a pair), and anything else would get a slice of the features and fail deep in torch
    with a shape error. "After" is ``named_modules()`` order, the order most models build
    their layers in. ``plan`` names modules (no patterns).
    """
    open_cols: list[str] = []
    for name, _ in module.named_modules():
        style = plan.get(name)
        if isinstance(style, ParallelStyle) and not getattr(style, "use_local_output", True):
            continue  # its output stays a DTensor that knows its layout (torch's loss_parallel takes one)
        side = _side(style)
        if side == "colwise":
            open_cols.append(name)
        elif side == "rowwise" and not open_cols:
            raise ValueError(
                f"the tensor-parallel plan splits {name} row-wise, but no column-wise layer before it gives it a split "
                f"input: add the column-wise side of its pair to the plan, or leave {name} out of it"
            )
        elif side == "rowwise":
            open_cols = []
    if open_cols:
        raise ValueError(
            f"the tensor-parallel plan splits {open_cols[0]} column-wise, but no row-wise layer after it takes its split "
            f"output, so the next layer would get a slice of its features: add the row-wise side of the pair, or make "
            f"{open_cols[0]} 'output' to gather its output whole"
        )


def check_pairs(module: nn.Module, plan: Mapping[str, Union[str, ParallelStyle]]) -> None:
    """Refuse a layer that needs all of a split pair's features (a BatchNorm, a LayerNorm) between its two sides.

    Between a column-wise layer and the row-wise one that closes the pair, each process holds
    a slice of the features: such a layer would fail deep in torch, or normalise a slice.
    ``plan`` names modules (no patterns).
    """
    for col, row, name, layer in _between_pairs(module, plan):
        features = _out_features(module.get_submodule(col))
        if _needs_features(layer, features):
            raise ValueError(
                f"the tensor-parallel plan splits {col} column-wise and {row} row-wise, but {name} ({type(layer).__name__}) "
                f"between them needs all {features} features and each process holds a slice: leave that pair out of the "
                f"plan (pass plan= without {col} and {row}) or move {name} outside the pair"
            )


def _side(style: Union[str, ParallelStyle, None]) -> str | None:
    """'colwise' for a layer whose output stays split over the processes; 'rowwise' for one taking split input."""
    if style == "colwise" or (isinstance(style, ColwiseParallel) and style.output_layouts[0] == Shard(-1)):
        return "colwise"
    if style == "rowwise" or (isinstance(style, RowwiseParallel) and style.input_layouts[0] == Shard(-1)):
        return "rowwise"
    return None


def _between_pairs(module: nn.Module, plan: Mapping[str, Union[str, ParallelStyle]]) -> Iterator[tuple[str, str, str, nn.Module]]:
    """(column-wise layer, row-wise layer, name, child) for each child registered between the two sides of a pair.

    "Between" is the order a parent registers its children in: an ``nn.Sequential``'s run
    order, and the order most models build their layers in (``fc``, then ``proj``).
    """
    for prefix, parent in module.named_modules():
        at = f"{prefix}." if prefix else ""
        col, inside = None, []
        for name, child in parent.named_children():
            side = _side(plan.get(f"{at}{name}"))
            if side == "colwise":
                col, inside = f"{at}{name}", []
            elif side == "rowwise" and col is not None:
                yield from ((col, f"{at}{name}", n, c) for n, c in inside)
                col = None
            elif col is not None and f"{at}{name}" not in plan:
                inside.append((f"{at}{name}", child))


def _out_features(layer: nn.Module) -> int:
    return layer.out_features if isinstance(layer, nn.Linear) else getattr(layer, "embedding_dim", -1)


def _needs_features(layer: nn.Module, features: int) -> bool:
    """Whether ``layer`` holds a tensor sized by ``features`` (a norm's weight or statistics) or normalises over them."""
    for sub in layer.modules():
        sizes = [getattr(sub, "num_features", None), getattr(sub, "num_channels", None), *getattr(sub, "normalized_shape", ())]
        tensors = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if features in sizes or any(features in t.shape for t in tensors):
            return True
    return False


def default_plan(module: nn.Module, degree: int) -> dict[str, str]:
    """Split the Linear pairs, embeddings and output layer that the common layouts name.

    A pair is a module's column-side children (``q``/``k``/``v``, ``fc``, ``w1``/``w3``, ...)
    with its one row-side child (``proj``, ``o_proj``, ``w2``, ...), or two Linear layers of an
    ``nn.Sequential`` with only element-wise layers between them. Layers whose split size
    ``degree`` does not divide, pairs with a norm between their sides, and both sides of a
    tied weight that would be split unlike, stay whole.
    """
    plan: dict[str, str] = {}
    for prefix, parent in module.named_modules():
        at = f"{prefix}." if prefix else ""
        linears = {n: c for n, c in parent.named_children() if isinstance(c, nn.Linear)}
        if isinstance(parent, nn.Sequential):
            _sequential_pairs(parent, at, degree, plan)
            continue
        cols = {n: c for n, c in linears.items() if n in COLWISE_NAMES}
        rows = [n for n in linears if n in ROWWISE_NAMES]
        if cols and len(rows) == 1 and all(c.out_features % degree == 0 for c in cols.values()) and linears[rows[0]].in_features % degree == 0:
            pair = {**{f"{at}{n}": "colwise" for n in cols}, f"{at}{rows[0]}": "rowwise"}
            if not any(_needs_features(c, _out_features(parent.get_submodule(col))) for col, _, _, c in _between_pairs(parent, _relative(pair, at))):
                plan.update(pair)  # a norm between the two sides needs every feature: that pair stays whole
    for name, child in module.named_children():
        if isinstance(child, nn.Embedding) and child.num_embeddings % degree == 0 and child.max_norm is None:
            plan[name] = "embedding"
        elif isinstance(child, nn.Linear) and name in OUTPUT_NAMES and child.out_features % degree == 0:
            plan[name] = "output"
    for names in tied_weights(module):
        if len({_weight_split(module, name, plan) for name in names}) > 1:
            for name in names:  # split unlike, the tied weight would become two: both sides stay whole
                plan.pop(name.rpartition(".")[0], None)
    if not plan:
        raise ValueError(
            f"found no layers of {type(module).__name__} to split over {degree} processes (Linear pairs named like "
            "attn.q/k/v/proj and mlp.fc/proj, or nn.Sequential Linear pairs): pass plan={'layer': 'colwise', ...}"
        )
    return plan


def _weight_split(module: nn.Module, name: str, plan: Mapping[str, str]) -> object:
    """How ``plan`` splits the parameter ``name``: the dimension of a weight, else the owner's style (None: whole)."""
    owner, _, attribute = name.rpartition(".")
    style = plan.get(owner)
    if style is None or attribute != "weight":
        return style
    dim = 0 if style in ("colwise", "output") else 1  # a Linear's weight is (out, in); an Embedding's (rows, width)
    return 1 - dim if isinstance(module.get_submodule(owner), nn.Embedding) else dim


def _sequential_pairs(seq: nn.Sequential, at: str, degree: int, plan: dict[str, str]) -> None:
    first: tuple[str, nn.Linear] | None = None
    for name, child in seq.named_children():
        if isinstance(child, nn.Linear):
            if first is None:
                first = (name, child)
                continue
            if first[1].out_features % degree == 0:
                plan[f"{at}{first[0]}"], plan[f"{at}{name}"] = "colwise", "rowwise"
                first = None
                continue
            first = (name, child)
        elif first is not None and (any(True for _ in child.parameters()) or any(True for _ in child.buffers()) or any(True for _ in child.children()) or _needs_features(child, first[1].out_features)):
            first = None  # a layer between them that mixes or normalises features: not an element-wise pair


def _relative(plan: dict[str, str], at: str) -> dict[str, str]:
    return {name[len(at):]: style for name, style in plan.items()}
