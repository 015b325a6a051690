"""TPUStrategy on virtual XLA CPU devices against eager torch on the same work, for information only.

Virtual CPU devices share this machine's cores, so these figures say nothing about TPU speed:
they show what the compiled step costs to build (compile time) and how it runs on 1 and on 8
devices next to torch's eager step on the same global batch (SGD with momentum, both ways).
Each device count needs its own process (XLA_FLAGS is read when JAX starts), so this script
runs itself once per count.

    python bench/xla.py [--steps 20] [--warmup 3]
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
from workloads import machine, save, small_cnn  # noqa: E402

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


def run(strategy: loom.Strategy, name: str, steps: int, warmup: int) -> dict[str, float]:
    """Seconds of the first step (compiling, for XLA) and steps/s after ``warmup`` more."""
    _, build, shape = WORKLOADS[name]
    torch.manual_seed(0)
    model, opt = strategy.prepare(build(), sgd)
    step = strategy.train_step(model, F.cross_entropy, opt)
    batches = iter(strategy.distribute(data(shape, 1 + warmup + steps), batch_size=BATCH, shuffle=False))
    start = time.perf_counter()
    float(step(*next(batches)))  # reading the loss waits for the step
    first = time.perf_counter() - start
    for _ in range(warmup):
        float(step(*next(batches)))
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(*next(batches))
    float(loss)
    return {"first_step_s": first, "steps_per_s": steps / (time.perf_counter() - start)}


def child(args: argparse.Namespace) -> None:
    strategy = loom.TPUStrategy()
    print(json.dumps({name: run(strategy, name, args.steps, args.warmup) for name in WORKLOADS}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the parent for its children
    args = parser.parse_args()
    if args.devices:
        return child(args)
    xla = {}
    for devices in (1, 8):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        done = subprocess.run([sys.executable, __file__, "--devices", str(devices), "--steps", str(args.steps), "--warmup", str(args.warmup)],
                              capture_output=True, text=True, env=env, check=True)  # fmt: skip
        xla[devices] = json.loads(done.stdout.strip().splitlines()[-1])
    eager = {name: run(loom.OneDeviceStrategy(), name, args.steps, args.warmup) for name in WORKLOADS}
    results: dict[str, Any] = {"machine": machine(), "steps": args.steps, "note": "virtual XLA CPU devices on a shared, loaded machine", "workloads": {}}
    for name, (description, _, _) in WORKLOADS.items():
        row = {
            "description": description,
            "xla_compile_s": xla[1][name]["first_step_s"],
            "xla_compile_s_8_devices": xla[8][name]["first_step_s"],
            "eager_torch_steps_per_s": eager[name]["steps_per_s"],
            "xla_1_device_steps_per_s": xla[1][name]["steps_per_s"],
            "xla_8_devices_steps_per_s": xla[8][name]["steps_per_s"],
        }
        row["xla_1_device_vs_eager"] = row["xla_1_device_steps_per_s"] / row["eager_torch_steps_per_s"]
        row["xla_8_devices_vs_eager"] = row["xla_8_devices_steps_per_s"] / row["eager_torch_steps_per_s"]
        results["workloads"][name] = row
        print(f"{name} ({description}): compile {row['xla_compile_s']:.2f}s (1 device), {row['xla_compile_s_8_devices']:.2f}s (8); "
              f"steps/s eager torch {row['eager_torch_steps_per_s']:.1f}, XLA 1 device {row['xla_1_device_steps_per_s']:.1f} "
              f"({row['xla_1_device_vs_eager']:.2f}x), 8 devices {row['xla_8_devices_steps_per_s']:.1f} ({row['xla_8_devices_vs_eager']:.2f}x)")  # fmt: skip
    print(f"wrote {save('xla', results)}")


if __name__ == "__main__":
    main()
