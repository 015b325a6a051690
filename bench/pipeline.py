"""Pipeline bubble and activation memory of loom's PipelineStrategy, measured against theory.

Every stage has a known cost: a layer that sleeps ``t`` in its forward and ``2t`` in its
backward (and holds a known activation for its backward), so what is measured is the
schedule itself, also on a machine with fewer cores than processes. A stage's idle fraction is
1 - (its time computing) / (the step's time); for GPipe and 1F1B, theory says
(p-1)/(m+p-1) for p stages and m micro-batches. Interleaved 1F1B (two stages per process,
each half the cost) must idle less than 1F1B; its theory is (p-1)/(2m+p-1). Peak activation memory is the largest number
of bytes a stage held for its backward at once: GPipe holds all m micro-batches, 1F1B at most
p. The same 1F1B step written directly on torch.distributed.pipelining is timed beside
loom's, for the overhead ratio.

    python bench/pipeline.py [--t 0.2] [--steps 2]   # about 8 minutes, mostly sleeping
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loom  # noqa: E402
from loom.launch import LaunchOptions, run_job  # noqa: E402
from workloads import RESULTS, machine, save  # noqa: E402

WIDTH = 256  # features per sample: each micro-batch's held activation is its input, rows x WIDTH x 4 bytes
ROWS = 4  # samples per micro-batch


class KnownCost(torch.autograd.Function):
    """Sleeps ``t`` forward and ``2t`` backward; counts the compute time and the bytes held for backward."""

    @staticmethod
    def forward(ctx, x, weight, t, meter):  # type: ignore[override]
        start = time.perf_counter()
        time.sleep(t)
        ctx.save_for_backward(x, weight)
        ctx.t, ctx.meter = t, meter
        meter.held += x.nbytes
        meter.peak = max(meter.peak, meter.held)
        meter.busy += time.perf_counter() - start
        return x * weight

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        start = time.perf_counter()
        x, weight = ctx.saved_tensors
        time.sleep(2 * ctx.t)
        ctx.meter.held -= x.nbytes
        ctx.meter.busy += time.perf_counter() - start
        return grad * weight, (grad * x).sum().reshape(1), None, None


class Meter:
    def __init__(self) -> None:
        self.busy, self.held, self.peak = 0.0, 0, 0


METER = Meter()  # one per process: what this process's stages computed


class Stage(nn.Module):
    def __init__(self, t: float) -> None:
        super().__init__()
        self.t = t
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return KnownCost.apply(x, self.weight, self.t, METER)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def measure_loom(schedule: str, virtual: int, m: int, t: float, steps: int) -> dict:
    """One configuration: the step's time and this process's compute time and peak held bytes."""
    strategy = loom.PipelineStrategy(schedule=schedule, virtual_stages=virtual, microbatches=m, timeout=600)
    p = dist.get_world_size()
    model, opt = strategy.prepare(nn.Sequential(*[Stage(t / virtual) for _ in range(p * virtual)]), lambda ps: torch.optim.SGD(ps, lr=0.0))
    step = strategy.train_step(model, mse, opt)
    x, y = torch.randn(m * ROWS, WIDTH), torch.randn(m * ROWS, WIDTH)
    step(x, y)  # warm-up: torch infers the shapes sent between stages
    return _timed(lambda: step(x, y), steps)


def measure_raw(m: int, t: float, steps: int) -> dict:
    """The same 1F1B step on torch.distributed.pipelining directly, one Stage layer per process."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, p = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(Stage(t), rank, p, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=mse)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.0)
    x, y = torch.randn(m * ROWS, WIDTH), torch.randn(m * ROWS, WIDTH)

    def step() -> None:
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == p - 1 else None)
        opt.step()
        opt.zero_grad()

    step()
    return _timed(step, steps)


def _timed(step, steps: int) -> dict:
    seconds, busy, peaks = [], [], []
    for _ in range(steps):
        dist.barrier()
        METER.busy, METER.held, METER.peak = 0.0, 0, 0  # a step ends with every backward done
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        busy.append(METER.busy)
        peaks.append(METER.peak)
    best = min(range(steps), key=lambda i: seconds[i])
    return {"seconds": seconds[best], "busy": busy[best], "peak_bytes": max(peaks)}


def worker(out: str, t: float, steps: int) -> None:
    p = int(os.environ["WORLD_SIZE"])  # the process group is joined by the first strategy
    results = []
    for m in (4, 8, 16):
        for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
            got = measure_loom(schedule, virtual, m, t, steps)
            results.append({"schedule": schedule, "p": p, "m": m, **_per_rank(got)})
    raw = _per_rank(measure_raw(8, t, steps))
    loom_1f1b = next(r for r in results if r["schedule"] == "1f1b" and r["m"] == 8)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"runs": results, "raw_1f1b_m8": raw, "loom_1f1b_m8": loom_1f1b}))


def _per_rank(got: dict) -> dict:
    """Every process's figures, gathered: idle fraction 1 - busy / the pipeline's step time, per stage."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, got)
    seconds = max(g["seconds"] for g in everyone)  # from the first stage's start to the last one's end
    idle = [1 - g["busy"] / seconds for g in everyone]
    return {
        "seconds": seconds,
        "idle_per_stage": idle,
        "idle": sum(idle) / len(idle),
        "peak_bytes_per_stage": [g["peak_bytes"] for g in everyone],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", type=float, default=0.2, help="seconds a stage's forward sleeps (backward: twice that)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration (the fastest is kept)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--replot", action="store_true", help="annotate and plot the saved results again, without measuring")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        return worker(args.worker_out, args.t, args.steps)
    if args.replot:
        results = json.loads((RESULTS / "pipeline.json").read_text())
        annotate(results["runs"])
        save("pipeline", results)
        return plot(results, RESULTS / "pipeline.png")
    runs, raw = [], {}
    for p in args.stages:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            entry = [__file__, "--worker-out", out.name, "--t", str(args.t), "--steps", str(args.steps)]
            if run_job(entry, LaunchOptions(nproc=p, threads=1, timeout=600)):
                raise SystemExit(f"the run on {p} processes failed")
            got = json.loads(Path(out.name).read_text())
        runs += got["runs"]
        raw[p] = {"torch_seconds": got["raw_1f1b_m8"]["seconds"], "loom_seconds": got["loom_1f1b_m8"]["seconds"]}
        raw[p]["loom_over_torch"] = raw[p]["loom_seconds"] / raw[p]["torch_seconds"]
    annotate(runs)
    for p, figures in raw.items():
        print(f"p={p} m=8 1F1B: loom {figures['loom_seconds']:.3f} s, torch.distributed.pipelining directly {figures['torch_seconds']:.3f} s: {figures['loom_over_torch']:.3f}x")
    results = {"machine": machine(), "t": args.t, "rows_per_microbatch": ROWS, "width": WIDTH, "runs": runs, "loom_vs_torch_1f1b_m8": raw}
    path = save("pipeline", results)
    plot(results, RESULTS / "pipeline.png")
    print(f"saved {path} and {RESULTS / 'pipeline.png'}")


def annotate(runs: list[dict]) -> None:
    """Theory beside each measurement: (p-1)/(v*m+p-1) with v stages per process (Megatron's bubble for v > 1)."""
    for r in runs:
        v = 2 if r["schedule"] == "interleaved_1f1b" else 1
        r["theory"] = (r["p"] - 1) / (v * r["m"] + r["p"] - 1)
        r["relative_error"] = abs(r["idle"] - r["theory"]) / r["theory"]
        if v == 1:
            r["within_10_percent"] = r["relative_error"] <= 0.10
        else:
            plain = next(o for o in runs if o["schedule"] == "1f1b" and o["p"] == r["p"] and o["m"] == r["m"])
            r["below_1f1b"] = r["idle"] < plain["idle"]
        print(f"p={r['p']} m={r['m']:2d} {r['schedule']:16s} idle {r['idle']:.3f} (theory {r['theory']:.3f}, "
              f"{r['relative_error']:.0%} off)  step {r['seconds']:.2f} s  peak held per stage {r['peak_bytes_per_stage']}")  # fmt: skip


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for p in sorted({r["p"] for r in runs}):
        ms = sorted({r["m"] for r in runs if r["p"] == p})
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], color="black", ls=":", lw=1)
        ax.plot(ms, [(p - 1) / (2 * m + p - 1) for m in ms], color="gray", ls="--", lw=1)
        for schedule, marker in (("gpipe", "o"), ("1f1b", "s"), ("interleaved_1f1b", "^")):
            points = sorted((r["m"], r["idle"]) for r in runs if r["p"] == p and r["schedule"] == schedule)
            ax.plot(*zip(*points), marker=marker, label=f"{schedule}, p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle fraction per stage")
    ax.set_title("bubble (dotted: (p-1)/(m+p-1); dashed, interleaved v=2: (p-1)/(2m+p-1))", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    for schedule in ("gpipe", "1f1b"):
        for p in sorted({r["p"] for r in runs}):
            points = sorted((r["m"], r["peak_bytes_per_stage"][0] / 1024) for r in runs if r["p"] == p and r["schedule"] == schedule)
            ax.plot(*zip(*points), marker="o", label=f"{schedule}, p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("peak activation KiB held, first stage")
    ax.set_title("activation memory: GPipe holds m micro-batches, 1F1B at most p", fontsize=10)
    ax.legend(fontsize=7)
    fig.suptitle("loom PipelineStrategy: stages of known cost (sleep t forward, 2t backward)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
