"""Does ``pool_nhwc`` pay? Eager's max-pool on a contiguous batch against loom's exact ``pool_nhwc``, interleaved.

    python bench/pool_nhwc.py [--rounds 7] [--repeats 5] [--steps 5]

Two measures, each at one and two intra-op threads:

- **the pool alone**, forward and backward, on W2's two pools (at the global batch, 256, and at a
  two-process job's share, 128), a ResNet stem's pool, a late small pool, and a batch of 8
  channels, which ``pool_nhwc`` leaves to eager's kernel (its ratio shows the cost of asking);
  and, with the channels_last path forced, a batch of 3 channels and a small one: the two
  bounds below which ``pool_nhwc`` leaves the batch to eager's kernel;
- **W2's training step** at loom's exact defaults, with ``pool_nhwc`` and with its pools handed
  back to ``nn.MaxPool2d`` (``reuse_memory`` and ``pool_before_relu`` in both, so the allocator is in the
  same state for both).

Each round times both contenders, in an order that alternates from round to round; a figure is
the median over rounds of that round's ratio (eager's time over pool_nhwc's). Writes
bench/results/pool_nhwc.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.workloads import RESULTS, WORKLOADS, machine, save  # noqa: E402
from loom.compat import swap_class  # noqa: E402
from loom.fast import allocator, exact, nhwc_max_pool  # noqa: E402

POOLS = {  # name: (input shape, kernel, stride, padding)
    "W2 pool 1, batch 256": ((256, 32, 32, 32), 2, 2, 0),
    "W2 pool 2, batch 256": ((256, 64, 16, 16), 2, 2, 0),
    "W2 pool 1, batch 128": ((128, 32, 32, 32), 2, 2, 0),
    "W2 pool 2, batch 128": ((128, 64, 16, 16), 2, 2, 0),
    "ResNet stem, 3x3/2": ((32, 64, 112, 112), 3, 2, 1),
    "late 2x2, 256 channels": ((64, 256, 14, 14), 2, 2, 0),
    "8 channels (eager's)": ((128, 8, 32, 32), 2, 2, 0),
}
FORCED = {  # at and below MIN_CHANNELS and MIN_ELEMENTS, the channels_last path forced: why eager's runs below
    "3 channels, forced": ((8, 3, 224, 224), 2, 2, 0),
    "8x16x8x8, forced": ((8, 16, 8, 8), 2, 2, 0),
    "64x16x8x8 (the bound)": ((64, 16, 8, 8), 2, 2, 0),
}


def interleaved(a: Callable[[], float], b: Callable[[], float], rounds: int) -> dict[str, object]:
    """Median over rounds of each round's a/b, both timed once a round, the order alternating."""
    a(), b()  # warm-up: oneDNN primitives, the heap filled
    ratios, seconds = [], {"eager": [], "pool_nhwc": []}
    for r in range(rounds):
        took = dict(reversed([("pool_nhwc", b()), ("eager", a())])) if r % 2 else {"eager": a(), "pool_nhwc": b()}
        for name, s in took.items():
            seconds[name].append(s)
        ratios.append(took["eager"] / took["pool_nhwc"])
    return {"gain": statistics.median(ratios), "ratios": ratios, "ms": {k: statistics.median(v) * 1e3 for k, v in seconds.items()}}


def pool_alone(shape: tuple, k: int, stride: int, padding: int, repeats: int, rounds: int) -> dict[str, object]:
    x = torch.randn(shape, requires_grad=True)
    plain, fast = nn.MaxPool2d(k, stride, padding), nn.MaxPool2d(k, stride, padding)
    nhwc_max_pool.use(nn.Sequential(fast))
    grad = torch.randn_like(plain(x))

    def timed(pool: nn.Module) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(repeats):
                torch.autograd.grad(pool(x), x, grad)
            return (time.perf_counter() - start) / repeats

        return run

    return interleaved(timed(plain), timed(fast), rounds)


def forced(shape: tuple, k: int, stride: int, padding: int, repeats: int, rounds: int) -> dict[str, object]:
    """``pool_alone`` with the channels_last path taken whatever the batch."""
    with mock.patch.multiple(nhwc_max_pool, MIN_CHANNELS=1, MIN_ELEMENTS=0):
        return pool_alone(shape, k, stride, padding, repeats, rounds)


def w2_steps(batch: int, steps: int, rounds: int) -> dict[str, object]:
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def contender(nhwc: bool) -> Callable[[], float]:
        torch.manual_seed(0)
        model = WORKLOADS["W2"].build()
        exact.apply(model, None)
        if not nhwc:
            for pool in [m for m in model.modules() if type(m) is nhwc_max_pool.NhwcMaxPool2d]:
                swap_class(pool, nn.MaxPool2d)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def run() -> float:
            start = time.perf_counter()
            for _ in range(steps):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return (time.perf_counter() - start) / steps

        return run

    return interleaved(contender(False), contender(True), rounds)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(results)
    for i, (threads, rows) in enumerate(results.items()):
        ax.barh([n + i * width for n in range(len(names))], [rows[name]["gain"] for name in names], width, label=f"{threads} thread(s)")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([n + width * (len(results) - 1) / 2 for n in range(len(names))], names)
    ax.invert_yaxis()
    ax.set_xlabel("eager's time / pool_nhwc's (median of the rounds' ratios)")
    ax.set_title("pool_nhwc against eager's max-pool, contiguous CPU batch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5, help="forward and backward passes a contender's turn")
    parser.add_argument("--steps", type=int, default=5, help="W2 training steps a contender's turn")
    args = parser.parse_args()
    allocator.keep()  # as loom's defaults: process-wide, so for both contenders alike
    results: dict[str, dict[str, object]] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        rows = results.setdefault(str(threads), {})
        for name, (shape, k, stride, padding) in {**POOLS, **FORCED}.items():
            rows[name] = (forced if name in FORCED else pool_alone)(shape, k, stride, padding, args.repeats, args.rounds)
            print(f"{threads} thread(s)  {name:24s} eager {rows[name]['ms']['eager']:6.2f} ms  pool_nhwc {rows[name]['ms']['pool_nhwc']:6.2f} ms  {rows[name]['gain']:.2f}x", flush=True)
        for batch in (256, 128):
            name = f"W2 training step, batch {batch}"
            rows[name] = w2_steps(batch, args.steps, args.rounds)
            print(f"{threads} thread(s)  {name:24s} eager {rows[name]['ms']['eager']:6.1f} ms  pool_nhwc {rows[name]['ms']['pool_nhwc']:6.1f} ms  {rows[name]['gain']:.2f}x", flush=True)
    path = save("pool_nhwc", {"machine": machine(), "rounds": args.rounds, "repeats": args.repeats, "steps": args.steps, "results": results})
    plot(results, RESULTS / "pool_nhwc.png")
    print(f"saved {path} and {RESULTS / 'pool_nhwc.png'}")


if __name__ == "__main__":
    main()
