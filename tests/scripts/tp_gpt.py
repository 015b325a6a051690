"""The model-parallel equivalence run: 10 clipped AdamW steps of a tiny GPT on real text.

``train(make)`` runs in every rank of a job (``tests.helpers.run_ranks``) and in the test
process under OneDeviceStrategy; each returns the whole weights (DTensor shards gathered)
and the norms before clipping. The batch is the same global batch whatever the strategy.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

import loom
from examples.gpt_model import GPT, GPTConfig, next_byte_loss, splits

CONFIG = GPTConfig(context=16, width=32, heads=4, layers=2)
GLOBAL_BATCH, STEPS, MAX_NORM = 8, 10, 0.5


def adamw(params: Any) -> torch.optim.Optimizer:
    """eps=1e-6: attention's key bias has a gradient of zero in exact arithmetic (softmax ignores a
    shift shared by every key), so in floats it is rounding noise, which Adam's default eps of 1e-8
    would turn into lr-sized steps of random sign, differently under any change of summation order."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def train(make: Callable[[], loom.Strategy]) -> dict[str, Any]:
    strategy = make()
    torch.manual_seed(0)
    model, opt = strategy.prepare(GPT(CONFIG), adamw)
    step = strategy.train_step(model, next_byte_loss, opt, max_grad_norm=MAX_NORM)
    train_set, _ = splits(CONFIG.context, max_bytes=CONFIG.context * GLOBAL_BATCH * STEPS + 1, val_fraction=0.0)
    norms, losses = [], []
    for x, y in strategy.distribute(train_set, batch_size=GLOBAL_BATCH, shuffle=False):
        losses.append(float(step(x, y)))
        norms.append(float(step.grad_norm))
    local = {n: tuple(p.to_local().shape) for n, p in loom.unwrap(model).named_parameters() if isinstance(p, DTensor)}
    weights = {k: whole(v) for k, v in loom.unwrap(model).state_dict().items()}
    return {"weights": weights, "norms": norms, "losses": losses, "local_shapes": local, "replicas": strategy.num_replicas_in_sync}
