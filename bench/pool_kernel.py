"""Does the pooling kernel pay? W2 training steps with ``channels_last`` against ``channels_last``
plus ``pool_kernel``, fp32 and bf16, in one process, interleaved.

    python bench/pool_kernel.py [--rounds 7] [--steps 10] [--threads N]

Each round times ``--steps`` SGD steps of each contender (forward, backward, update; the order
alternates from round to round) after a warm-up that includes the kernel's compile. Both
contenders run with reuse_memory, so the allocator is in the same state for both. The result is
the median over rounds of the per-round ratio (channels_last time / with the kernel time), one
per precision: the kernel stays in loom only if one of them reaches 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.workloads import WORKLOADS, machine, save  # noqa: E402
from loom.fast import fast_path  # noqa: E402

KEEP_IF = 1.10  # the gain the kernel must show in one precision to stay


def contender(pool_kernel: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = WORKLOADS["W2"].build()
    fast_path.apply(model, fast_path.FastPath(channels_last=True, pool_kernel=pool_kernel, reuse_memory=True))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def timed_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int, bf16: bool) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps


def measure(bf16: bool, rounds: int, steps: int) -> dict[str, object]:
    x = torch.randn(256, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (256,))
    plain, kernel = contender(False), contender(True)
    for model, opt in (plain, kernel):
        timed_steps(model, opt, x, y, 3, bf16)  # warm-up: oneDNN primitives, the kernel's compile
    ratios, seconds = [], {"channels_last": [], "channels_last+pool_kernel": []}
    for r in range(rounds):
        order = [("channels_last", plain), ("channels_last+pool_kernel", kernel)]
        took = {name: timed_steps(*pair, x, y, steps, bf16) for name, pair in (order if r % 2 == 0 else order[::-1])}
        for name, s in took.items():
            seconds[name].append(s)
        ratios.append(took["channels_last"] / took["channels_last+pool_kernel"])
        print(f"  {'bf16' if bf16 else 'fp32'} round {r + 1}: channels_last {took['channels_last'] * 1e3:.1f} ms, "
              f"+pool_kernel {took['channels_last+pool_kernel'] * 1e3:.1f} ms, {ratios[-1]:.3f}x", flush=True)  # fmt: skip
    return {"median_gain": statistics.median(ratios), "ratios": ratios, "seconds_per_step": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    parser.add_argument("--out", default="pool_kernel")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    found = {precision: measure(precision == "bf16", args.rounds, args.steps) for precision in ("fp32", "bf16")}
    best = max(f["median_gain"] for f in found.values())
    verdict = "keep" if best >= KEEP_IF else "remove"
    for precision, f in found.items():
        print(f"W2 {precision}: channels_last+pool_kernel is {f['median_gain']:.3f}x channels_last (median of {args.rounds} rounds)")
    print(f"pool_kernel: {verdict} (best median gain {best:.3f}x, needs {KEEP_IF:.2f}x)")
    save(args.out, {"machine": machine(), "threads": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps,
                    "results": found, "verdict": verdict})  # fmt: skip


if __name__ == "__main__":
    main()
