"""The user's torch optimizer, as a pure JAX update inside the compiled step.

torch's SGD (momentum, dampening, nesterov, weight decay, maximize), Adam and AdamW (weight
decay, decoupled or not, maximize) are rewritten here with torch's formulas, so the compiled
step trains as torch would. Hyper-parameters are read from ``param_groups`` at every step and
passed to the program as values, so an LR scheduler changes them without a recompile. What
changes the program's shape (the class, nesterov, momentum on or off) is its signature.
Anything else is refused by name rather than approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = "torch.optim.SGD, Adam and AdamW"


@dataclass(frozen=True)
class GroupRule:
    """What is fixed in the program for one parameter group."""

    kind: str  # "sgd" | "adam"
    momentum: bool = False
    nesterov: bool = False
    maximize: bool = False
    decoupled: bool = False


def group_rules(optimizer: torch.optim.Optimizer) -> tuple[GroupRule, ...]:
    """One rule per parameter group; a one-line refusal for what the compiled step cannot run exactly."""
    name = type(optimizer).__name__
    rules = []
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ValueError(f"TPUStrategy cannot run {name}(differentiable=True) in its compiled step; leave it False")
        if isinstance(optimizer, torch.optim.SGD) and type(optimizer) is torch.optim.SGD:
            rules.append(GroupRule("sgd", group["momentum"] != 0, bool(group["nesterov"]), bool(group["maximize"])))
        elif isinstance(optimizer, torch.optim.Adam) and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            if group["amsgrad"]:
                raise ValueError(f"TPUStrategy cannot run {name}(amsgrad=True) in its compiled step; use amsgrad=False")
            decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
            rules.append(GroupRule("adam", maximize=bool(group["maximize"]), decoupled=decoupled))
        else:
            raise ValueError(
                f"TPUStrategy runs the optimizer inside its compiled step and knows {SUPPORTED}, not {name}; "
                "use one of those or another strategy"
            )
    return tuple(rules)


def group_hypers(optimizer: torch.optim.Optimizer) -> list[dict[str, float]]:
    """This step's hyper-parameters of every group, as plain numbers (a scheduler may have changed them)."""
    hypers = []
    for group in optimizer.param_groups:
        h = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"])}
        if "momentum" in group:
            h.update(momentum=float(group["momentum"]), dampening=float(group["dampening"]))
        else:
            h.update(beta1=float(group["betas"][0]), beta2=float(group["betas"][1]), eps=float(group["eps"]))
        hypers.append(h)
    return hypers


def slot_names(rule: GroupRule) -> tuple[str, ...]:
    """torch's names for a parameter's optimizer state, in the optimizer's ``state[p]``."""
    if rule.kind == "sgd":
        return ("momentum_buffer",) if rule.momentum else ()
    return ("exp_avg", "exp_avg_sq")


def update(rule: GroupRule, h: dict[str, Any], p: Any, g: Any, slots: dict[str, Any], step: Any) -> tuple[Any, dict[str, Any], Any]:
    """One parameter's torch update in jax.numpy: (new parameter, new slots, new step count).

    ``step`` counts this parameter's earlier updates (torch's ``state['step']`` for Adam; for
    SGD, whether the momentum buffer exists yet).
    """
    import jax.numpy as jnp

    if rule.maximize:
        g = -g
    step = step + 1
    if rule.kind == "sgd":
        g = g + h["weight_decay"] * p
        new = {}
        if rule.momentum:
            buf = jnp.where(step == 1, g, h["momentum"] * slots["momentum_buffer"] + (1 - h["dampening"]) * g)
            new["momentum_buffer"] = buf
            g = g + h["momentum"] * buf if rule.nesterov else buf
        return p - h["lr"] * g, new, step
    if rule.decoupled:
        p = p * (1 - h["lr"] * h["weight_decay"])
    else:
        g = g + h["weight_decay"] * p
    m = slots["exp_avg"] + (1 - h["beta1"]) * (g - slots["exp_avg"])
    v = h["beta2"] * slots["exp_avg_sq"] + (1 - h["beta2"]) * g * g
    step_size = h["lr"] / (1 - h["beta1"] ** step)
    denom = jnp.sqrt(v) / jnp.sqrt(1 - h["beta2"] ** step) + h["eps"]
    return p - step_size * m / denom, {"exp_avg": m, "exp_avg_sq": v}, step
