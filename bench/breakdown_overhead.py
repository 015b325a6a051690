"""What the step breakdown's recording costs per step, against the same loop without it and plain PyTorch.

Three contenders in one process and one thread (OneDeviceStrategy: the hooks do not depend on
communication), in interleaved blocks with the order alternating per round, so machine noise
hits all alike. Each block is timed in CPU seconds of this process (``time.process_time``),
not wall time: on a machine shared with other jobs the wall clock mostly measures the others.

- plain PyTorch: the hand-written loop;
- loom, recording off: the strategy's recorder replaced by one that does nothing;
- loom, recording on: as shipped (a forward pre-hook, a hook per parameter, two optimizer hooks).

On two tiny models (all fixed cost: 2 parameters, and 200, since each parameter has a hook)
the contenders are compared from the least disturbed block of each; on a busy machine that
difference is within the noise, so the recorder's own work is also timed directly (its hooks
called as torch calls them, thousands of times) as a fixed cost plus a cost per parameter.
That is related to the step time of the training workloads W1 and W2 (``bench/workloads.py``),
measured in the same run, whose own on/off ratio is shown but is within the machine's noise.

    python bench/breakdown_overhead.py [--rounds 4] [--block 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loom  # noqa: E402
from workloads import RESULTS, TINY, WORKLOADS, Workload, endless, loom_step, machine, save, sgd_step  # noqa: E402

CONTENDERS = ("plain PyTorch", "loom, recording off", "loom, recording on")
MANY = Workload("many", "200 parameters: 100 x Linear 8->8, global batch 64", 64, lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)]), (8,), classes=8)


class NoRecording:
    """A recorder that hooks nothing and records nothing: loom as it was before the breakdown."""

    in_train_step = False

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def steps_for(workload: Workload, batches: int) -> dict[str, Callable[[], None]]:
    data = workload.data(batches=batches)
    torch.manual_seed(0)
    plain = workload.build()
    opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    off = loom.OneDeviceStrategy()
    off.__dict__["step_recorder"] = NoRecording()  # the cached property, taken before prepare hooks anything
    return {
        "plain PyTorch": sgd_step(plain, opt, endless(DataLoader(data, batch_size=workload.global_batch, shuffle=True)), lambda loss: loss.backward()),
        "loom, recording off": loom_step(off, workload, data),
        "loom, recording on": loom_step(loom.OneDeviceStrategy(), workload, data),
    }


def cpu_timed(step: Callable[[], None], steps: int) -> float:
    """CPU seconds this process spends on ``steps`` steps."""
    start = time.process_time()
    for _ in range(steps):
        step()
    return time.process_time() - start


def measure(workload: Workload, rounds: int, block: int, pick: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """CPU seconds per step of each contender: the ``pick`` (median, or min: the least disturbed block) of its blocks."""
    steps = steps_for(workload, batches=8)
    for step in steps.values():
        cpu_timed(step, 2)
    seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for round_ in range(rounds):
        for name in CONTENDERS if round_ % 2 == 0 else CONTENDERS[::-1]:
            seconds[name].append(cpu_timed(steps[name], block) / block)
    return {name: pick(s) for name, s in seconds.items()}


def direct_cost_us(parameters: int, steps: int = 2000, blocks: int = 7) -> float:
    """CPU microseconds per step of the recorder's own work, its hooks called as torch calls them
    (a forward pre-hook, one gradient hook per parameter, the optimizer's pre and post hooks),
    from the least disturbed of ``blocks`` blocks: what on/off comparisons cannot resolve here."""
    from loom.diagnostics.breakdown import StepRecorder

    recorder = StepRecorder()
    x = torch.zeros(8, 4)
    grads = [torch.zeros(1) for _ in range(parameters)]
    best = float("inf")
    for _ in range(blocks):
        start = time.process_time()
        for _ in range(steps):
            recorder._forward_hook(None, (x,))
            for g in grads:
                recorder._grad_hook(g)
            recorder.backward_done()
            recorder._optimizer_pre_hook(None, (), {})
            recorder._optimizer_post_hook(None, (), {})
        best = min(best, (time.process_time() - start) / steps)
    return best * 1e6


def paired_cost_us(workload: Workload, pairs: int, block: int) -> float:
    """Median over adjacent (off, on) blocks of the CPU difference per step: pairing cancels the
    machine's slow drift, which dwarfs the difference between separate medians here."""
    steps = steps_for(workload, batches=8)
    off, on = steps["loom, recording off"], steps["loom, recording on"]
    cpu_timed(off, 5)
    cpu_timed(on, 5)
    differences = []
    for i in range(pairs):
        first, second = (off, on) if i % 2 == 0 else (on, off)
        a, b = cpu_timed(first, block), cpu_timed(second, block)
        differences.append((b - a if first is off else a - b) / block * 1e6)
    return statistics.median(differences)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (x3 for the tiny models)")
    parser.add_argument("--block", type=int, default=100, help="tiny-model steps per timed block")
    args = parser.parse_args()
    torch.set_num_threads(1)  # CPU time then is the step's work, not threads spinning while descheduled
    results: dict[str, Any] = {"machine": machine(), "rounds": args.rounds, "fixed_cost_us": {}, "workloads": {}}
    for workload in (TINY, MANY):
        per_step = measure(workload, 6 * args.rounds, args.block, pick=min)
        cost = paired_cost_us(workload, 10 * args.rounds, args.block)
        params = sum(1 for _ in workload.build().parameters())
        results["fixed_cost_us"][workload.name] = {"parameters": params, "us_per_step": {k: v * 1e6 for k, v in per_step.items()}, "recording_us": cost}
        print(f"{workload.name} ({workload.description}): " + "  ".join(f"{k} {v * 1e6:.1f} us" for k, v in per_step.items()) + f"  -> recording costs {cost:.1f} us/step (median of paired blocks)", flush=True)
    direct = direct_cost_us(0)
    direct_per_parameter = (direct_cost_us(200) - direct) / 200
    results["recording_us_direct"] = {"fixed": direct, "per_parameter": direct_per_parameter}
    print(f"the recorder's own Python, called directly: {direct:.2f} us per step + {direct_per_parameter:.3f} us per parameter", flush=True)
    tiny, many = results["fixed_cost_us"]["tiny"], results["fixed_cost_us"]["many"]
    per_parameter = max((many["recording_us"] - tiny["recording_us"]) / (many["parameters"] - tiny["parameters"]), 0.0)
    fixed = max(tiny["recording_us"] - per_parameter * tiny["parameters"], 0.0)
    results["recording_us_paired"] = {"fixed": fixed, "per_parameter": per_parameter}
    print(f"recording with torch's hook dispatch (paired blocks): {fixed:.1f} us per step + {per_parameter:.2f} us per parameter", flush=True)
    for workload in WORKLOADS.values():
        per_step = measure(workload, args.rounds, 3)
        off, on = per_step["loom, recording off"], per_step["loom, recording on"]
        recording_us = fixed + per_parameter * sum(1 for _ in workload.build().parameters())
        results["workloads"][workload.name] = {
            "description": workload.description,
            "ms_per_step": {k: v * 1e3 for k, v in per_step.items()},
            "measured_ratio_on_to_off": on / off,
            "recording_us": recording_us,
            "recording_share_of_step": recording_us * 1e-6 / off,
        }
        print(
            f"{workload.name} ({workload.description}): " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in per_step.items())
            + f"  -> on/off {on / off:.3f}x (noise); the {recording_us:.1f} us of recording is {recording_us * 1e-6 / off:.4%} of a step",
            flush=True,
        )  # fmt: skip
    path = save("breakdown_overhead", results)
    plot(results, RESULTS / "breakdown_overhead.png")
    print(f"saved {path} and {RESULTS / 'breakdown_overhead.png'}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(results["fixed_cost_us"])
    width = 0.8 / len(CONTENDERS)
    for i, contender in enumerate(CONTENDERS):
        left.bar([j + i * width for j in range(len(names))], [results["fixed_cost_us"][n]["us_per_step"][contender] for n in names], width, label=contender)
    left.set_xticks([j + width for j in range(len(names))], names)
    left.set_ylabel("CPU us per step (one thread)")
    left.set_title("fixed cost per step")
    left.legend(fontsize=8)
    workloads = list(results["workloads"])
    for i, contender in enumerate(CONTENDERS):
        right.bar([j + i * width for j in range(len(workloads))], [results["workloads"][w]["ms_per_step"][contender] for w in workloads], width, label=contender)
    right.set_xticks([j + width for j in range(len(workloads))], workloads)
    right.set_ylabel("CPU ms per step (one thread)")
    right.set_title("training workloads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
