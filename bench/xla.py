"""TPUStrategy on virtual XLA CPU devices against eager torch on the same work, for information only.

Virtual CPU devices share this machine's cores, so these figures say nothing about TPU speed:
they show what the compiled step costs to build (compile time) and how it runs on 1 and on 8
devices next to torch's eager step on the same global batch (SGD with momentum, both ways).
Each device count needs its own process (XLA_FLAGS is read when JAX starts), so this script
runs itself once per count.

    python bench/xla.py [--steps 10] [--rounds 2] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loom  # noqa: E402
from workloads import RESULTS, machine, save, small_cnn  # noqa: E402

WORKLOADS = {
    "MLP": ("MLP 784-512-512-10, global batch 256", lambda: nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)), (784,)),
    "CNN": ("small CNN on 3x32x32, global batch 256", small_cnn, (3, 32, 32)),
}
BATCH = 256


def data(shape: tuple[int, ...], batches: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(BATCH * batches, *shape, generator=g), torch.randint(0, 10, (BATCH * batches,), generator=g))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


class Runner:
    """A workload's step under one strategy, built once and timed in blocks."""

    def __init__(self, strategy: loom.Strategy, name: str, batches: int) -> None:
        _, build, shape = WORKLOADS[name]
        torch.manual_seed(0)
        model, opt = strategy.prepare(build(), sgd)
        self.step = strategy.train_step(model, F.cross_entropy, opt)
        self.batches = iter(strategy.distribute(data(shape, batches), batch_size=BATCH, shuffle=False))
        self.first_step_s = self.block(1)  # compiling, for XLA

    def block(self, steps: int) -> float:
        """Seconds for ``steps`` steps; reading the last loss waits for them."""
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.step(*next(self.batches))
        float(loss)
        return time.perf_counter() - start


def child(args: argparse.Namespace) -> None:
    """XLA and eager torch in alternating blocks in this process, so load on the machine hits both alike."""
    results = {}
    for name in WORKLOADS:
        batches = 1 + args.warmup + args.rounds * args.steps
        xla, eager = Runner(loom.TPUStrategy(), name, batches), Runner(loom.OneDeviceStrategy(), name, batches)
        xla.block(args.warmup)
        eager.block(args.warmup)
        seconds = {"xla": 0.0, "eager": 0.0}
        for _ in range(args.rounds):
            seconds["xla"] += xla.block(args.steps)
            seconds["eager"] += eager.block(args.steps)
        steps = args.rounds * args.steps
        results[name] = {"compile_s": xla.first_step_s, "xla_steps_per_s": steps / seconds["xla"], "eager_steps_per_s": steps / seconds["eager"]}
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=2, help="blocks of each contender, alternating")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the parent for its children
    args = parser.parse_args()
    if args.devices:
        return child(args)
    xla = {}
    for devices in (1, 8):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        options = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
        done = subprocess.run([sys.executable, __file__, "--devices", str(devices), *options],
                              capture_output=True, text=True, env=env, check=True)  # fmt: skip
        xla[devices] = json.loads(done.stdout.strip().splitlines()[-1])
    results: dict[str, Any] = {"machine": machine(), "steps": args.rounds * args.steps, "workloads": {},
                               "note": "virtual XLA CPU devices on a shared, loaded machine; eager torch timed in the same process"}  # fmt: skip
    for name, (description, _, _) in WORKLOADS.items():
        row: dict[str, Any] = {"description": description}
        for devices in (1, 8):
            got = xla[devices][name]
            row[f"{devices}_device"] = {**got, "xla_vs_eager": got["xla_steps_per_s"] / got["eager_steps_per_s"]}
        results["workloads"][name] = row
        one, eight = row["1_device"], row["8_device"]
        print(f"{name} ({description}): compile {one['compile_s']:.1f}s (1 device), {eight['compile_s']:.1f}s (8); steps/s "
              f"1 device {one['xla_steps_per_s']:.1f} vs eager torch {one['eager_steps_per_s']:.1f} ({one['xla_vs_eager']:.2f}x), "
              f"8 devices {eight['xla_steps_per_s']:.1f} vs {eight['eager_steps_per_s']:.1f} ({eight['xla_vs_eager']:.2f}x)")  # fmt: skip
    plot(results, RESULTS / "xla.png")
    print(f"wrote {save('xla', results)} and {RESULTS / 'xla.png'}")


def plot(results: dict[str, Any], path: Path) -> None:
    """Steps/s of eager torch and of the compiled step, per workload and device count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.5))
    for ax, name in zip(axes, names):
        row = results["workloads"][name]
        labels = ["eager torch\n(1-device run)", "XLA 1 device", "eager torch\n(8-device run)", "XLA 8 devices"]
        values = [row["1_device"]["eager_steps_per_s"], row["1_device"]["xla_steps_per_s"], row["8_device"]["eager_steps_per_s"], row["8_device"]["xla_steps_per_s"]]
        ax.bar(labels, values, color=["grey", "tab:blue", "grey", "tab:orange"])
        ax.set_title(f"{row['description']}\ncompile {row['1_device']['compile_s']:.0f}s / {row['8_device']['compile_s']:.0f}s", fontsize=9)
        ax.set_ylabel("steps/s")
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("TPUStrategy on virtual XLA CPU devices (loaded machine; not TPU speed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
