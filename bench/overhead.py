"""loom MirroredStrategy against hand-written DDP with identical settings, 2 processes.

Both run in the same processes on the same process group, in interleaved blocks of steps
(order alternating per round), so machine noise hits both alike; the ratio is what counts.
Whichever model is built first runs about 2% faster here (allocator placement), so every
workload is measured twice, once in each build order, and the step times are pooled.
What loom's own Python adds per step is measured apart, in one process, where it resolves.
Hand-written DDP: DistributedSampler + DataLoader, DDP(bucket_cap_mb=25,
gradient_as_bucket_view=True), loss.backward(). loom also runs with precision="bf16-mixed".

    python bench/overhead.py [--rounds 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loom  # noqa: E402
from workloads import RESULTS, TINY, WORKLOADS, Workload, endless, loom_step, machine, save, sgd_step, timed  # noqa: E402

CONTENDERS = ("hand-written DDP", "loom fp32", "loom bf16-mixed")


def ddp_step(workload: Workload, data) -> Callable[[], None]:
    """The same step written by hand: DistributedSampler, DataLoader, DDP, loss.backward()."""
    torch.manual_seed(0)
    model = DistributedDataParallel(workload.build(), bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    batches = endless(DataLoader(data, batch_size=workload.global_batch // dist.get_world_size(), sampler=sampler))
    return sgd_step(model, opt, batches, lambda loss: loss.backward())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4, help="rounds per build order")
    parser.add_argument("--steps", type=int, default=5, help="steps per block; timed steps = 2 * rounds * steps")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    fp32 = loom.MirroredStrategy()
    bf16 = loom.MirroredStrategy(precision="bf16-mixed")  # joins the same process group
    results: dict = {"machine": machine(), "replicas": fp32.num_replicas_in_sync, "workloads": {}}
    for workload in WORKLOADS.values():
        data = workload.data(batches=16)
        seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for build_order in (CONTENDERS, CONTENDERS[::-1]):
            makers = {
                "hand-written DDP": lambda: ddp_step(workload, data),
                "loom fp32": lambda: loom_step(fp32, workload, data),
                "loom bf16-mixed": lambda: loom_step(bf16, workload, data),
            }
            steps = {name: makers[name]() for name in build_order}
            for step in steps.values():
                timed(step, args.warmup)
            for round_ in range(args.rounds):
                for name in CONTENDERS if round_ % 2 == 0 else CONTENDERS[::-1]:
                    seconds[name].append(timed(steps[name], args.steps) / args.steps)
            del steps
        throughput = {name: workload.global_batch / statistics.median(s) for name, s in seconds.items()}
        base = throughput["hand-written DDP"]
        results["workloads"][workload.name] = {
            "description": workload.description,
            "timed_steps": 2 * args.rounds * args.steps,
            "samples_per_sec": throughput,
            "ratio_to_ddp": {name: value / base for name, value in throughput.items()},
            "step_seconds": seconds,
        }
        if fp32.is_chief:
            ratios = "  ".join(f"{n}: {v:,.0f}/s ({v / base:.3f}x)" for n, v in throughput.items())
            print(f"{workload.name} ({workload.description}): {ratios}", flush=True)
    results["python_us_per_step"] = python_cost_per_step(args.rounds)
    if fp32.is_chief:
        costs = results["python_us_per_step"]
        print(f"loom's own Python per step (tiny model, one process, no communication): plain loop "
              f"{costs['plain PyTorch loop']:.1f} us, loom {costs['loom loop']:.1f} us "
              f"(+{costs['loom loop'] - costs['plain PyTorch loop']:.1f} us)")  # fmt: skip
        path = save("overhead", results)
        plot(results, RESULTS / "overhead.png")
        print(f"saved {path} and {RESULTS / 'overhead.png'}")


def python_cost_per_step(rounds: int) -> dict[str, float]:
    """Microseconds per step of loom's loop and of the plain loop on a tiny model, in this
    process and without communication (loom's DDP is the same DDP): what loom's own Python adds.

    Measured this way because a 2-process tiny-model step is dominated by gloo scheduling
    noise of +-150 us on this machine, far above the difference being measured.
    """
    data = TINY.data(batches=200)
    torch.manual_seed(0)
    plain = TINY.build()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    plain_batches = endless(DataLoader(data, batch_size=TINY.global_batch, shuffle=True))
    steps = {
        "plain PyTorch loop": sgd_step(plain, plain_opt, plain_batches, lambda loss: loss.backward()),
        "loom loop": loom_step(loom.OneDeviceStrategy(), TINY, data),
    }
    micros: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(5 * rounds):
        for name in list(steps) if round_ % 2 == 0 else list(steps)[::-1]:
            micros[name].append(timed(steps[name], 200, sync=lambda: None) / 200 * 1e6)
    return {name: statistics.median(m) for name, m in micros.items()}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(CONTENDERS)
    for i, contender in enumerate(CONTENDERS):
        values = [results["workloads"][w]["samples_per_sec"][contender] for w in names]
        bars = ax.bar([j + i * width for j in range(len(names))], values, width, label=contender)
        ax.bar_label(bars, [f"{results['workloads'][w]['ratio_to_ddp'][contender]:.2f}x" for w in names], fontsize=8)
    ax.set_xticks([j + width for j in range(len(names))], [f"{w}\n{results['workloads'][w]['description']}" for w in names], fontsize=8)
    ax.set_ylabel("samples / s (2 processes)")
    ax.set_title("loom MirroredStrategy vs hand-written DDP (ratio to DDP on bars)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    loom.launch(main, nproc=2)
