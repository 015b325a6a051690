"""Samples/s of loom MirroredStrategy at 1, 2, ... replicas on this machine, and the efficiency.

Each configuration is its own job, as a user would run it. Two views, because on a CPU a
single process can use every core through threads:

* speedup: N replicas with the default budget of cores/N threads each, against 1 replica
  using all cores, i.e. what data parallelism adds on this machine;
* scaling efficiency: N replicas of one core (thread) each, against N times 1 replica of one
  core, the per-device view (one replica per GPU), which isolates the cost of the all-reduce.

    python bench/scaling.py [--replicas 1 2] [--blocks 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loom  # noqa: E402
from loom.devices import available_cores  # noqa: E402
from loom.launch import LaunchOptions, run_job  # noqa: E402
from workloads import RESULTS, WORKLOADS, loom_step, machine, save, timed  # noqa: E402


def measure(out: str, blocks: int, steps: int) -> None:
    """Worker: time each workload's training steps; the chief writes samples/s to ``out``."""
    strategy = loom.MirroredStrategy()
    results = {}
    for workload in WORKLOADS.values():
        step = loom_step(strategy, workload, workload.data(batches=8))
        timed(step, 3)  # warm-up
        seconds = [timed(step, steps) / steps for _ in range(blocks)]
        results[workload.name] = workload.global_batch / statistics.median(seconds)
    if strategy.is_chief:
        Path(out).write_text(json.dumps({"samples_per_sec": results, "threads": torch.get_num_threads()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    cores = available_cores()
    default = [n for n in (1, 2, 4, 8) if n <= cores]
    parser.add_argument("--replicas", type=int, nargs="+", default=default, help=f"replica counts (default: up to the {cores} cores)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        return measure(args.worker_out, args.blocks, args.steps)
    configs = sorted({(n, max(1, cores // n)) for n in args.replicas} | {(n, 1) for n in args.replicas})
    runs = {}
    for n, threads in configs:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            entry = [__file__, "--worker-out", out.name, "--blocks", str(args.blocks), "--steps", str(args.steps)]
            if run_job(entry, LaunchOptions(nproc=n, threads=threads)):
                raise SystemExit(f"the run with {n} replica(s) of {threads} thread(s) failed")
            runs[(n, threads)] = json.loads(Path(out.name).read_text())["samples_per_sec"]
        print(f"{n} replica(s) x {threads} thread(s): " + "  ".join(f"{w} {v:,.0f} samples/s" for w, v in runs[(n, threads)].items()), flush=True)
    one_all, one_single = runs[(1, cores)], runs[(1, 1)]
    results: dict = {"machine": machine(), "cores": cores, "runs": [{"replicas": n, "threads": t, "samples_per_sec": v} for (n, t), v in runs.items()]}
    results["speedup_vs_one_process_all_cores"] = {w: {n: runs[(n, max(1, cores // n))][w] / one_all[w] for n in args.replicas} for w in WORKLOADS}
    results["efficiency_one_core_per_replica"] = {w: {n: runs[(n, 1)][w] / (n * one_single[w]) for n in args.replicas} for w in WORKLOADS}
    for w in WORKLOADS:
        speedup = "  ".join(f"{n}: {v:.2f}x" for n, v in results["speedup_vs_one_process_all_cores"][w].items())
        efficiency = "  ".join(f"{n}: {v:.0%}" for n, v in results["efficiency_one_core_per_replica"][w].items())
        print(f"{w} speedup over 1 process on all cores [{speedup}]; efficiency at one core per replica [{efficiency}]")
    path = save("scaling", results)
    plot(results, WORKLOADS, RESULTS / "scaling.png")
    print(f"saved {path} and {RESULTS / 'scaling.png'}")


def plot(results: dict, workloads: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cores = results["cores"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    views = [("all cores shared: cores/N threads each", lambda r: r["threads"] == max(1, cores // r["replicas"])),
             ("one core (thread) per replica", lambda r: r["threads"] == 1)]  # fmt: skip
    for ax, (title, keep) in zip(axes, views):
        for w in workloads:
            points = sorted((r["replicas"], r["samples_per_sec"][w]) for r in results["runs"] if keep(r))
            xs, ys = zip(*points)
            line = ax.plot(xs, ys, marker="o", label=f"{w}: {workloads[w].description}")[0]
            if "one core" in title:
                ax.plot(xs, [ys[0] * x / xs[0] for x in xs], ls=":", color=line.get_color())
        ax.set_xticks(sorted({r["replicas"] for r in results["runs"]}))
        ax.set_xlabel(f"replicas (processes) on {cores} cores")
        ax.set_ylabel("samples / s")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("loom MirroredStrategy scaling (dotted: linear)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
