"""The behaviours every strategy keeps, each a function of a strategy factory.

``make(**options)`` builds the strategy under test in this process (with ``precision=``); a
case returns plain values and tensors, which the tests compare with OneDeviceStrategy's on
the same global batch. Every replica runs every case; the runners return each replica's
results so the tests can also check that the replicas agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom
from tests.contract.models import GPT, VOCAB, BatchNormCNN, images, tokens

GLOBAL_BATCH = 16
STEPS = 3
Make = Callable[..., loom.Strategy]


def data(n: int = GLOBAL_BATCH * STEPS, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, ((x[:, 0] + x[:, 1]) > 0).long())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in loom.unwrap(model).state_dict().items()}


def _train(make: Make, optimizer: Callable = sgd, precision: str = "32", batch: int = GLOBAL_BATCH, **step_options: Any) -> dict[str, Any]:
    strategy = make(precision=precision)
    model, opt = strategy.prepare(mlp(), optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if step_options.pop("schedule", False) else None
    step = strategy.train_step(model, F.cross_entropy, opt, scheduler=scheduler, **step_options)
    seen = []
    loom.unwrap(model)[0].register_forward_hook(lambda module, args, out: seen.append(str(out.dtype)))
    norms = []
    for x, y in strategy.distribute(data(), batch_size=batch, shuffle=False):
        step(x, y)
        if step.grad_norm is not None:
            norms.append(float(step.grad_norm))
    return {"weights": weights(model), "lr": opt.param_groups[0]["lr"], "norms": norms, "forward_dtypes": sorted(set(seen))}


def sgd_momentum(make: Make) -> dict[str, Any]:
    return _train(make)


def adamw_weight_decay(make: Make) -> dict[str, Any]:
    return _train(make, adamw)


def _eager(strategy: loom.Strategy, model: nn.Module, opt: torch.optim.Optimizer, batch: int = GLOBAL_BATCH) -> None:
    """The eager loop over the data, ``backward`` then ``step``, in batches of ``batch``."""
    for x, y in strategy.distribute(data(), batch_size=batch, shuffle=False):
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()


def eager_loop(make: Make) -> dict[str, Any]:
    """The eager loop gives what ``train_step`` gives (compared with ``sgd_momentum``)."""
    strategy = make()
    model, opt = strategy.prepare(mlp(), sgd)
    _eager(strategy, model, opt)
    return {"weights": weights(model)}


def bf16_mixed(make: Make) -> dict[str, Any]:
    return _train(make, precision="bf16-mixed")


def fp16_mixed(make: Make) -> dict[str, Any]:
    return _train(make, adamw, precision="16-mixed")


def accumulate_in_step(make: Make) -> dict[str, Any]:
    """Two micro-batches per batch equal the batch at once (compared with ``sgd_momentum``)."""
    return _train(make, accumulate=2)


def accumulate_eager(make: Make) -> dict[str, Any]:
    """``accumulate(2)`` over half-size batches equals the whole batch (compared with ``sgd_momentum``)."""
    strategy = make()
    model, opt = strategy.prepare(mlp(), sgd)
    with strategy.accumulate(2):
        _eager(strategy, model, opt, GLOBAL_BATCH // 2)
    return {"weights": weights(model)}


def clipping(make: Make) -> dict[str, Any]:
    return _train(make, max_grad_norm=0.05)


def step_lr(make: Make) -> dict[str, Any]:
    return _train(make, accumulate=2, schedule=True)


def reduce_and_gather(make: Make) -> dict[str, Any]:
    """Over every process that feeds the step: a replica's, or a TPU host's, which covers its devices."""
    strategy = make()
    if isinstance(strategy, loom.TPUStrategy):  # its replicas are devices; one process per host reduces
        processes, index = strategy.num_hosts, strategy.host_id
    else:
        processes, index = strategy.num_replicas_in_sync, strategy.replica_id
    mine = index + 1
    return {
        "sum": strategy.reduce(mine, "sum"),
        "mean": float(strategy.reduce(torch.tensor(float(mine)), "mean")),
        "max": strategy.reduce(mine, "max"),
        "gathered": strategy.gather(torch.tensor([mine])).tolist(),
        "replicas": processes,
    }


def fit_metrics(make: Make) -> dict[str, Any]:
    """Losses, accuracy and torchmetrics' AUROC and F1 over every replica's samples, and predictions of every
    sample in order; 40 validation samples leave an uneven last batch."""
    strategy = make()
    untrained = mlp()  # built first: the parameter-server rows run their workers as threads of one process,
    # and a thread's data loading seeds torch's global generator while another builds a model
    history = loom.fit(mlp(), F.cross_entropy, sgd, data(), val_data=data(40, 9), epochs=2, batch_size=GLOBAL_BATCH,
                       shuffle=False, metrics=["accuracy", "auroc", "f1"], strategy=strategy, progress=False)  # fmt: skip
    predicted = loom.predict(untrained, data(40, 9), batch_size=GLOBAL_BATCH, strategy=strategy)
    return {k: v for k, v in history.items() if k != "samples_per_sec"} | {"predicted": predicted.flatten().tolist()}


def save_and_restore(make: Make, directory: Path, reference: Path) -> dict[str, Any]:
    """Save a trained model and optimizer under this strategy; restore OneDevice's checkpoint into it."""
    strategy = make()
    model, opt = strategy.prepare(mlp(), sgd)
    step = strategy.train_step(model, F.cross_entropy, opt)
    for x, y in strategy.distribute(data(), batch_size=GLOBAL_BATCH, shuffle=False):
        step(x, y)
    strategy.save(directory, step=STEPS, model=model, optimizer=opt)
    if strategy.trains_across_groups:  # replica groups train one model a strategy: a resumed run makes its own
        strategy = make()
    fresh, fresh_opt = strategy.prepare(mlp(), sgd)
    strategy.restore(reference, model=fresh, optimizer=fresh_opt)
    momentum = {k: v["momentum_buffer"].clone() for k, v in fresh_opt.state_dict()["state"].items()}
    return {"saved": weights(model), "restored": weights(fresh), "restored_momentum": momentum}


# ---- the shapes real scripts bring (tests/contract/models.py) -------------------------------------
def _seeded_per_rank(build: Callable[[], nn.Module]) -> nn.Module:
    """Each process seeds its own way before building the model, as nanoGPT does: rank 0's weights must win."""
    torch.manual_seed(100 + (dist.get_rank() if dist.is_initialized() else 0))
    return build()


def _train_on(strategy: loom.Strategy, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Any, dataset: Any) -> Any:
    step = strategy.train_step(model, loss_fn, opt)
    for x, y in strategy.distribute(dataset, batch_size=GLOBAL_BATCH, shuffle=False):
        step(x, y)
    return step


def gpt_own_loss(make: Make) -> dict[str, Any]:
    """nanoGPT's shape: nested blocks, tied embedding and head, per-rank seeds, ``forward(idx, targets)`` returning its loss."""
    strategy = make()
    model, opt = strategy.prepare(_seeded_per_rank(GPT), sgd)  # Adam's first steps turn the replicas' rounding into 1e-3
    _train_on(strategy, model, opt, None, tokens(GLOBAL_BATCH * STEPS))
    return {"weights": weights(model)}


def gpt_output_object(make: Make) -> dict[str, Any]:
    """An output object with attributes (Hugging Face's shape) keeps its class under mixed precision
    (untied, so that a pipeline, which refuses weights tied across stages, runs it too)."""
    strategy = make(precision="bf16-mixed")
    model, opt = strategy.prepare(_seeded_per_rank(lambda: GPT(output_object=True, tied=False)), sgd)
    loss_fn = lambda out, y: F.cross_entropy(out.logits.float().reshape(-1, VOCAB), y.reshape(-1))  # noqa: E731
    step = _train_on(strategy, model, opt, loss_fn, tokens(GLOBAL_BATCH * STEPS))
    return {"weights": weights(model), "output_class": type(step.outputs).__name__}


def batchnorm_cnn(make: Make) -> dict[str, Any]:
    """Running statistics and parameters as one device's over the global batch (``sync_batchnorm`` where a strategy has it)."""
    try:
        strategy = make(sync_batchnorm=True)
    except TypeError:  # a strategy without the option
        strategy = make()
    model, opt = strategy.prepare(_seeded_per_rank(BatchNormCNN), sgd)
    _train_on(strategy, model, opt, F.cross_entropy, images(GLOBAL_BATCH * STEPS))
    return {"weights": weights(model)}


COMPILE_BACKEND = "aot_eager"  # traces as inductor does (dynamo, fake tensors, AOT autograd) without minutes of C++ builds on 2 cores


def compile_before_prepare(make: Make, directory: Path) -> dict[str, Any]:
    """``prepare(torch.compile(model))``: trains as the model would, and its checkpoint's keys are the model's."""
    strategy = make()
    model, opt = strategy.prepare(torch.compile(mlp(), backend=COMPILE_BACKEND), sgd)
    _train_on(strategy, model, opt, F.cross_entropy, data())
    strategy.save(directory, step=STEPS, model=model)
    return {"weights": weights(model), "path": str(directory)}


def compile_after_prepare(make: Make, directory: Path) -> dict[str, Any]:
    """``torch.compile(prepare(model))``, the same."""
    strategy = make()
    model, opt = strategy.prepare(mlp(), sgd)
    model = torch.compile(model, backend=COMPILE_BACKEND)
    _train_on(strategy, model, opt, F.cross_entropy, data())
    strategy.save(directory, step=STEPS, model=model)
    return {"weights": weights(model), "path": str(directory)}


def fit_then_save(make: Make, directory: Path) -> dict[str, Any]:
    """``fit``, then ``save(model=...)`` with the very module the user passed to it."""
    strategy = make()
    model = mlp()
    loom.fit(model, F.cross_entropy, sgd, data(), epochs=1, batch_size=GLOBAL_BATCH, shuffle=False, strategy=strategy, progress=False)
    strategy.save(directory, step=STEPS, model=model)
    return {"path": str(directory)}


def restore_of_nothing(make: Make, directory: Path) -> dict[str, Any]:
    """``restore`` of an empty and of a missing directory returns None and changes nothing: the
    optimizer (no step taken), scheduler and data position are as before, and training then
    equals ``adamw_weight_decay`` (Adam's step count decides every update's size)."""
    strategy = make()
    model, opt = strategy.prepare(mlp(), adamw)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # restored, never stepped
    loader = strategy.distribute(data(), batch_size=GLOBAL_BATCH, shuffle=False)
    state = {"model": model, "optimizer": opt, "scheduler": scheduler, "loader": loader}
    before = [_plain(v.state_dict()) for v in (opt, scheduler, loader)]
    (directory / "empty").mkdir(parents=True, exist_ok=True)
    returned = [strategy.restore(directory / "empty", **state), strategy.restore(directory / "missing", **state)]
    unchanged = [_plain(v.state_dict()) == b for v, b in zip((opt, scheduler, loader), before)]
    step = strategy.train_step(model, F.cross_entropy, opt)
    for x, y in loader:
        step(x, y)
    return {"weights": weights(model), "returned": [r is None for r in returned], "unchanged": unchanged}


def _plain(tree: Any) -> Any:
    """``tree`` with its tensors as lists, so two states compare with ``==``."""
    if isinstance(tree, torch.Tensor):
        return tree.tolist()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return tree


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    fn.__name__: fn
    for fn in (sgd_momentum, adamw_weight_decay, eager_loop, bf16_mixed, fp16_mixed, accumulate_in_step,
               accumulate_eager, clipping, step_lr, reduce_and_gather, fit_metrics, save_and_restore,
               gpt_own_loss, gpt_output_object, batchnorm_cnn, compile_before_prepare, compile_after_prepare, fit_then_save, restore_of_nothing)
}  # fmt: skip


def run_case(name: str, make: Make, checkpoints: Path) -> dict[str, Any]:
    """One case, with the checkpoint directories the saving cases need."""
    if name == "save_and_restore":
        return CASES[name](make, checkpoints / "saved", checkpoints / "reference")
    if name in ("fit_then_save", "compile_before_prepare", "compile_after_prepare", "restore_of_nothing"):
        return CASES[name](make, checkpoints / name)
    return CASES[name](make)


def save_reference(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint every strategy restores: one SGD step on OneDevice, momentum included."""
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(mlp(), sgd)
    x, y = (t.to(strategy.device) for t in data()[:GLOBAL_BATCH])
    strategy.backward(F.cross_entropy(model(x), y))
    opt.step()
    strategy.save(directory, step=1, model=model, optimizer=opt)
    return weights(model)
