"""The model-parallel equivalence run: 10 clipped AdamW steps of a tiny GPT on real text, the last batch short.

``train(make)`` runs in every rank of a job (``tests.helpers.run_ranks``) and in the test
process under OneDeviceStrategy; each returns the whole weights (DTensor shards gathered)
and the norms before clipping. The batch is the same global batch whatever the strategy.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import loom
from examples.gpt_model import GPT, GPTConfig, next_byte_loss, splits

CONFIG = GPTConfig(context=16, width=32, heads=4, layers=2)
GLOBAL_BATCH, STEPS, MAX_NORM = 8, 10, 0.5
LAST_BATCH = 4  # the last of the STEPS batches is short: a pipeline runs it unpipelined


def adamw(params: Any) -> torch.optim.Optimizer:
    """eps=1e-6: attention's key bias has a gradient of zero in exact arithmetic (softmax ignores a
    shift shared by every key), so in floats it is rounding noise, which Adam's default eps of 1e-8
    would turn into lr-sized steps of random sign, differently under any change of summation order."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def merged(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The whole model's weights from the processes' results (a pipeline's stages each hold a part)."""
    weights: dict[str, torch.Tensor] = {}
    for rank in ranks:
        weights.update(rank["weights"])
    return weights


class TiedGPT(GPT):
    """The GPT with its output layer's weight tied to the input embedding, as GPT-2 and nanoGPT have it."""

    def __init__(self, config: GPTConfig = CONFIG) -> None:
        super().__init__(config)
        self.head.weight = self.embed.weight


def train(
    make: Callable[[], loom.Strategy], save_to: str | None = None, *, seed_by_rank: bool = False,
    build: Callable[[GPTConfig], GPT] = GPT, compile: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``save_to``: a directory the trained model and optimizer are saved in, at the end.

    ``seed_by_rank``: each process seeds ``torch.manual_seed(rank)`` before building the model,
    as nanoGPT does; OneDevice's run (seed 0) is rank 0's. ``compile``: "before" or "after"
    ``prepare``, with the aot_eager backend (traced and differentiated, no code generated).
    """
    strategy = make()
    torch.manual_seed(dist.get_rank() if seed_by_rank and dist.is_initialized() else 0)
    gpt = build(CONFIG)
    # The MLP's forward calls (activation checkpointing starts them again in backward), in a tensor:
    # torch.compile would guard on a list's length and compile again at every call.
    calls = torch.zeros((), dtype=torch.long)
    gpt.blocks[-1].mlp.register_forward_pre_hook(counter(calls))
    model, opt = strategy.prepare(torch.compile(gpt, backend="aot_eager") if compile == "before" else gpt, adamw)
    if compile == "after":
        model = torch.compile(model, backend="aot_eager")
    step = strategy.train_step(model, next_byte_loss, opt, max_grad_norm=MAX_NORM)
    train_set, _ = splits(CONFIG.context, max_bytes=CONFIG.context * (GLOBAL_BATCH * (STEPS - 1) + LAST_BATCH) + 1, val_fraction=0.0)
    norms, losses = [], []
    for x, y in strategy.distribute(train_set, batch_size=GLOBAL_BATCH, shuffle=False):
        losses.append(float(step(x, y)))
        norms.append(float(step.grad_norm))
    if save_to is not None:
        strategy.save(save_to, step=STEPS, model=model, optimizer=opt)
    local = {n: tuple(p.to_local().shape) for n, p in loom.unwrap(model).named_parameters() if isinstance(p, DTensor)}
    weights = {k: whole(v) for k, v in loom.unwrap(model).state_dict().items() if not v.is_meta}  # a pipeline stage: its own
    user = loom.unwrap(model)
    return {"weights": weights, "norms": norms, "losses": losses, "local_shapes": local, "replicas": strategy.num_replicas_in_sync,
            "mlp_calls": int(calls), "compiled_graphs": compiled_graphs(), "tied": user.head.weight is user.embed.weight}


def counter(calls: torch.Tensor) -> Callable[..., None]:
    def count(*_: Any) -> None:  # returns None: a forward pre-hook's result would replace the inputs
        calls.add_(1)

    return count


def compiled_graphs() -> int:
    """Graphs torch.compile has traced and differentiated in this process so far (0 if it never ran)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters  # test-only: torch has no public counter of compiled graphs

    return counters["aot_autograd"]["ok"]
