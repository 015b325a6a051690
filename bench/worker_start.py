"""What a worker's start and restart cost: forked from loom's zygote against new interpreters.

Each round launches the same job twice, alternating which goes first: ``loom run --nproc N
--max-restarts 1`` of a script that builds MirroredStrategy, takes one step and, on its first
attempt, fails on the last rank, so the job restarts once. One launch forks its workers from the
zygote (the default), the other starts each as a new Python (``LOOM_FORK_WORKERS=0``). Measured:
the launch's wall time and the CPU time of it and every process it started (RUSAGE_CHILDREN),
medians over the rounds, and their ratios.

    python bench/worker_start.py [--nproc 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import machine, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOB = """
import os, sys, torch, loom
strategy = loom.MirroredStrategy()
model, opt = strategy.prepare(torch.nn.Linear(8, 2), lambda p: torch.optim.SGD(p, lr=0.1))
strategy.backward(model(torch.randn(4, 8)).sum())
opt.step()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and strategy.cluster.rank == strategy.cluster.world_size - 1:
    sys.exit(3)
"""
CONTENDERS = {"forked (default)": "1", "new interpreters": "0"}


def launch(script: Path, nproc: int, fork: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one launch and everything it started."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "loom.launch.cli", "run", "--nproc", str(nproc), "--max-restarts", "1", str(script)],
        cwd=ROOT, env={**os.environ, "LOOM_FORK_WORKERS": fork, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the job failed:\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp(prefix="loom-bench-")) / "job.py"
    script.write_text(JOB)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CONTENDERS}
    for round_ in range(args.rounds):
        order = list(CONTENDERS) if round_ % 2 == 0 else list(CONTENDERS)[::-1]
        for name in order:
            runs[name].append(launch(script, args.nproc, CONTENDERS[name]))
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{n} {runs[n][-1][0]:.2f} s wall {runs[n][-1][1]:.2f} s CPU" for n in CONTENDERS), flush=True)
    medians = {name: {"wall_s": statistics.median(w for w, _ in r), "cpu_s": statistics.median(c for _, c in r)} for name, r in runs.items()}
    forked, fresh = medians["forked (default)"], medians["new interpreters"]
    ratios = {"wall": forked["wall_s"] / fresh["wall_s"], "cpu": forked["cpu_s"] / fresh["cpu_s"]}
    print(f"\n{args.nproc} processes, one restart; medians of {args.rounds} interleaved rounds")
    for name, m in medians.items():
        print(f"  {name:18s} {m['wall_s']:6.2f} s wall  {m['cpu_s']:6.2f} s CPU")
    print(f"  forked / new:      {ratios['wall']:.2f}x wall  {ratios['cpu']:.2f}x CPU")
    path = save("worker_start", {"machine": machine(), "nproc": args.nproc, "rounds": args.rounds, "medians": medians, "ratios": ratios,
                                  "runs": {n: [{"wall_s": w, "cpu_s": c} for w, c in r] for n, r in runs.items()}})  # fmt: skip
    print(f"saved {path}")


if __name__ == "__main__":
    main()
