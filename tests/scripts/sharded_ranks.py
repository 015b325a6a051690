"""What tests/strategies/test_sharded.py runs on its ranks (``run_ranks``): one job per world size, many findings."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import loom
from examples.gpt_model import GPT, GPTConfig, next_byte_loss, splits
from tests.scripts.tp_gpt import TiedGPT

CONFIG = GPTConfig(context=16, width=32, heads=2, layers=2)
GLOBAL_BATCH, STEPS, MAX_NORM = 8, 10, 0.5
TIED_STEPS = 3


def gpt_data() -> Any:
    train, _ = splits(context=CONFIG.context, max_bytes=20_000)
    return torch.utils.data.Subset(train, range(GLOBAL_BATCH * STEPS))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def train_gpt(strategy: loom.Strategy, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    """10 AdamW steps of the small GPT on the global batch, clipped: the run every strategy must match."""
    return _steps(strategy, *strategy.prepare(model, adamw))


def _steps(
    strategy: loom.Strategy, model: nn.Module, opt: torch.optim.Optimizer, steps: int = STEPS
) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    step = strategy.train_step(model, next_byte_loss, opt, max_grad_norm=MAX_NORM)
    norms = []
    data = torch.utils.data.Subset(gpt_data(), range(GLOBAL_BATCH * steps))
    for x, y in strategy.distribute(data, batch_size=GLOBAL_BATCH, shuffle=False):
        step(x, y)
        norms.append(float(step.grad_norm))
    return model, opt, norms


def full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def two_ranks(directory: Path) -> dict[str, Any]:
    """Every finding of the two-process job, each gathered whole."""
    found: dict[str, Any] = {}
    strategy = loom.ShardedStrategy(timeout=60)
    torch.manual_seed(strategy.replica_id)  # seeded per rank, as nanoGPT does: the shards are cut from rank 0's model
    model, opt, norms = train_gpt(strategy, GPT(CONFIG))
    found["weights"], found["norms"] = full(model.state_dict()), norms
    found["units"] = sum(isinstance(m, torch.distributed.fsdp.FSDPModule) for m in model.modules())
    found["local_params"] = sum(p.to_local().numel() for p in model.parameters())
    found["local_adam"] = sum(s["exp_avg"].to_local().numel() for s in opt.state.values())
    found["total_params"] = sum(p.numel() for p in model.parameters())
    strategy.save(directory / "gpt", step=STEPS, model=model, optimizer=opt)

    torch.manual_seed(0)  # restored from OneDevice's checkpoint (the test process writes it first)
    fresh, fresh_opt = strategy.prepare(GPT(CONFIG), adamw)
    strategy.restore(directory / "one_device", model=fresh, optimizer=fresh_opt)
    found["restored"] = full(fresh.state_dict())
    found["restored_exp_avg"] = full({str(i): s["exp_avg"] for i, s in enumerate(fresh_opt.state.values())})

    torch.manual_seed(strategy.replica_id)
    with strategy.scope(init=GPT._init):
        lazy = GPT(CONFIG)
    found["built_on_meta"] = all(p.is_meta for p in lazy.parameters())
    strategy.prepare(lazy)
    found["scope_weights"] = full(lazy.state_dict())
    found["scope_local_params"] = sum(p.to_local().numel() for p in lazy.parameters())

    torch.manual_seed(0)
    tied, _, _ = _steps(strategy, *strategy.prepare(TiedGPT(CONFIG), adamw), steps=TIED_STEPS)
    found["tied"], found["still_tied"] = full(tied.state_dict()), tied.head.weight is tied.embed.weight

    found["fp16_overflow"] = _overflow_on_one_rank(strategy)
    found["options"] = _options()
    for name, make in {
        "bad_wrap": lambda: loom.ShardedStrategy(wrap=[nn.Conv2d], timeout=60).prepare(GPT(CONFIG)),
        "offload_on_cpu": lambda: loom.ShardedStrategy(offload=True, timeout=60),
        "no_reset_parameters": lambda: strategy.prepare(_raw_parameter_model(strategy)),
        "wrap_not_a_class": lambda: loom.ShardedStrategy(wrap=["Block"], timeout=60).prepare(GPT(CONFIG)),
        "num_replicas": lambda: loom.ShardedStrategy(num_replicas=3, timeout=60),
        "fast_path": lambda: strategy.prepare(GPT(CONFIG), fast_path=True, example_input=torch.zeros(2, 8, dtype=torch.long)),
    }.items():
        try:
            make()
            found[name] = "no error"
        except (ValueError, TypeError, loom.ClusterError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _options() -> dict[str, Any]:
    """What wrap=, reshard_after_forward= and an optimizer built before prepare() do."""
    from examples.gpt_model import MLP

    found: dict[str, Any] = {}
    model = loom.ShardedStrategy(wrap=[MLP], timeout=60).prepare(GPT(CONFIG))
    found["mlp_units"] = [name for name, m in model.named_modules() if isinstance(m, torch.distributed.fsdp.FSDPModule)]
    for reshard in (True, False):
        model = loom.ShardedStrategy(reshard_after_forward=reshard, timeout=60).prepare(GPT(CONFIG))
        model(torch.zeros(1, 4, dtype=torch.long))
        found[f"gathered_after_forward_{reshard}"] = not isinstance(model.blocks[0].mlp.fc.weight, DTensor)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    early = adamw(model.parameters())  # built before prepare, on the unsharded parameters
    strategy = loom.ShardedStrategy(timeout=60)
    model, opt = strategy.prepare(model, early)
    _, _, found["early_optimizer_norms"] = _steps(strategy, model, opt, steps=2)
    return found


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def _raw_parameter_model(strategy: loom.ShardedStrategy) -> nn.Module:
    with strategy.scope():
        return nn.Sequential(nn.Linear(4, 4), Scale())


def _overflow_on_one_rank(strategy: loom.Strategy) -> dict[str, Any]:
    """An inf in replica 1's gradient shard only: fp16 must skip the step on both replicas."""
    fp16 = loom.ShardedStrategy(precision="16-mixed", timeout=60)
    model, opt = fp16.prepare(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), lambda p: torch.optim.SGD(p, lr=0.1))
    before = full(model.state_dict())
    fp16.backward(model(torch.ones(2, 4)).sum())
    if strategy.replica_id == 1:
        next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
    scale = opt.scaler.get_scale()
    opt.step()
    opt.zero_grad()
    opt.scaler.settle()  # loom's scaler updates its scale when the next loss is scaled
    return {"moved": max((v - before[k]).abs().max().item() for k, v in full(model.state_dict()).items()),
            "scale_before": scale, "scale_after": opt.scaler.get_scale()}  # fmt: skip


class Wide(nn.Module):
    """16 blocks of 768x768: 9.4M parameters, 144 MiB with gradients and AdamW's two moments."""

    def __init__(self, blocks: int = 16, width: int = 768) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def four_ranks_memory() -> dict[str, float]:
    """Peak resident memory (MiB) a process adds while building Wide under scope() and taking an AdamW step.

    Run with MALLOC_MMAP_THRESHOLD_ fixed, so that malloc returns every freed tensor over 1 MiB
    to the system and the peak counts tensors alive at once, not blocks kept for reuse.
    """
    strategy = loom.ShardedStrategy(timeout=60)
    warm, warm_opt = strategy.prepare(Wide(2, 64), lambda p: torch.optim.AdamW(p, lr=1e-3))
    _step(strategy, warm, warm_opt, 64)  # library code paged in now is not the model's memory
    del warm, warm_opt
    baseline = _resident_mb()
    _reset_peak()
    with strategy.scope():
        model = Wide()
    model, opt = strategy.prepare(model, lambda p: torch.optim.AdamW(p, lr=1e-3))
    _step(strategy, model, opt, 768)  # the first step holds all: parameters, gradients, and the new AdamW state
    params = sum(p.numel() for p in model.parameters())
    return {"peak_added_mb": _peak_mb() - baseline, "full_state_mb": params * 4 * 4 / 2**20,
            "block_mb": 768 * 768 * 4 / 2**20, "replicas": strategy.num_replicas_in_sync}  # fmt: skip


def _step(strategy: loom.Strategy, model: nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    strategy.train_step(model, lambda out, _: out.square().mean(), opt)(torch.randn(4, width), None)


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _reset_peak() -> None:
    """Linux resets the process's peak resident size (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
