"""The measured compute fast path against eager, bf16-mixed, and TensorFlow's figures, W1 and W2.

    python bench/fast_path.py [--nproc 1 2] [--rounds 3] [--steps 3] [--compile]

For each number of processes and each workload, one job (``loom run --nproc N``) runs every
contender in the same processes, in interleaved blocks of steps (order rotating per round), so
that each workload's trial starts on a fresh allocator, as a training script's does:

- ``eager fp32``: ``strategy.prepare(model, opt)``;
- ``fast path fp32``: ``prepare(..., fast_path=[...], example_input=x)``, whose one line is kept;
- ``bf16-mixed + fast path``: the same under ``precision="bf16-mixed"``.

Candidates: every one but compile. reuse_memory is process-wide, so each contender's
blocks run on the allocator its own trial chose (eager's on glibc's thresholds where they slide
to, as a trial leaves them), after one untimed step.

TensorFlow 2.21 fp32 (``bench/peers/tf_peer.py``, MultiWorkerMirrored with as many workers as
loom has processes and as many intra-op threads each) runs in the same run, just before and just
after each loom job, when ``.venv-tf`` exists (``make bench-tf``); else issue 15's figures stand in. ``torch.compile`` is a
candidate only with ``--compile`` (its compile time on this 2-core machine is minutes). A
``torch.profiler`` table of one W2 fp32 step, eager and channels_last, shows where the time goes
(bench/w2_profile.py sets it beside TensorFlow's, operator by operator).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.peers.run import launch, missing  # noqa: E402
from bench.workloads import RESULTS, WORKLOADS, endless, machine, save  # noqa: E402
from loom.fast import fast_path  # noqa: E402

TF_FP32 = {("W1", 2): 1986, ("W2", 1): 1105, ("W2", 2): 1118}  # samples/s, issue 15's table: used when TF is missing
TF_STEPS = {"W1": 20, "W2": 10}
CONTENDERS = ("eager fp32", "fast path fp32", "bf16-mixed + fast path")


def worker(rounds: int, steps: int, candidates: list[str], name: str, out: str) -> None:
    import loom

    results: dict = {}
    workload = WORKLOADS[name]
    data = workload.data(batches=4)
    contenders, lines, allocator = {}, {}, {}
    for contender in CONTENDERS:
        strategy = loom.auto_strategy(precision="bf16-mixed" if contender.startswith("bf16") else "32", timeout=600)
        torch.manual_seed(0)
        loader = strategy.distribute(data, batch_size=workload.global_batch)
        example = next(iter(loader))[0]
        options = {} if contender == "eager fp32" else {"fast_path": candidates, "example_input": example}
        if fast_path._reusing:  # each trial starts from a process that does not keep memory
            fast_path.reuse_memory(False)
        said = io.StringIO()
        with redirect_stdout(said):
            model, opt = strategy.prepare(workload.build(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), **options)
        lines[contender] = said.getvalue().strip()
        step = strategy.train_step(model, F.cross_entropy, opt)
        batches = endless(loader)
        contenders[contender] = lambda step=step, batches=batches: step(*next(batches))
        allocator[contender] = "reuse_memory" in lines[contender].split(" (")[0]
    for contender, run in contenders.items():
        _allocator(allocator[contender])
        run()
    seconds: dict[str, list[float]] = {c: [] for c in contenders}
    order = list(contenders)
    for r in range(rounds):
        for contender in order[r % len(order):] + order[: r % len(order)]:
            _allocator(allocator[contender])  # process-wide: each contender runs on its own choice
            contenders[contender]()  # untimed: after a change of allocator, its heap fills
            _barrier()
            start = time.perf_counter()
            for _ in range(steps):
                contenders[contender]()
            _barrier()
            seconds[contender].append((time.perf_counter() - start) / steps)
    results[name] = {
        c: {"samples_per_sec": workload.global_batch / statistics.median(s), "blocks": s, "choice": lines[c]}
        for c, s in seconds.items()
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        if int(os.environ.get("WORLD_SIZE", "1")) == 1 and name == "W2":
            results["profile"] = profile()
        Path(out).write_text(json.dumps(results))


def _allocator(reuse: bool) -> None:
    if fast_path._reusing != reuse:
        fast_path.reuse_memory(reuse)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def profile() -> dict[str, list[tuple[str, float]]]:
    """Self CPU time of the top operators in one W2 fp32 step, eager and channels_last."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    workload = WORKLOADS["W2"]
    x, y = torch.randn(workload.global_batch, 3, 32, 32), torch.randint(0, 10, (workload.global_batch,))
    tables = {}
    for layout in ("eager", "channels_last"):
        torch.manual_seed(0)
        model = workload.build()
        if layout == "channels_last":
            model = model.to(memory_format=torch.channels_last)
        F.cross_entropy(model(x), y).backward()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            F.cross_entropy(model(x), y).backward()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        tables[layout] = [(e.key, e.self_cpu_time_total / 1e3) for e in events]
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="try torch.compile too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    candidates = [c for c in fast_path.CANDIDATES if c != "compile" or args.compile]
    if args.worker:
        return worker(args.rounds, args.steps, candidates, args.worker, args.out)
    no_tf = missing("tensorflow")
    tf_fp32: dict[tuple[str, int], float] = dict(TF_FP32) if no_tf else {}
    print(f"TensorFlow not measured ({no_tf}); issue 15's figures stand in" if no_tf else "TensorFlow measured in this run")
    results: dict = {"machine": machine(), "candidates": candidates, "tf_measured_here": not no_tf, "load_average": os.getloadavg(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            tf_rates: dict[str, list[float]] = {name: [] for name in WORKLOADS}
            if not no_tf:
                _measure_tf(tf_rates, nproc, Path(tmp))
            for name in WORKLOADS:
                out = Path(tmp) / f"{nproc}-{name}.json"
                command = [sys.executable, "-m", "loom.launch.cli", "run", "--nproc", str(nproc), "--timeout", "900", __file__, "--worker", name,
                           "--rounds", str(args.rounds), "--steps", str(args.steps), "--out", str(out), *(["--compile"] if args.compile else [])]  # fmt: skip
                done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"--nproc {nproc} {name} failed: {done.stderr[-3000:]}")
                results["runs"].setdefault(str(nproc), {}).update(json.loads(out.read_text()))
            if not no_tf:
                _measure_tf(tf_rates, nproc, Path(tmp))
                tf_fp32.update({(name, nproc): statistics.median(rates) for name, rates in tf_rates.items()})
    results["tf_fp32"] = {f"{w} {n}": v for (w, n), v in tf_fp32.items()}
    for nproc, run in results["runs"].items():
        for name in WORKLOADS:
            tf = tf_fp32.get((name, int(nproc)))
            for contender, row in run[name].items():
                row["vs_tf_fp32"] = row["samples_per_sec"] / tf if tf else None
                versus = f"{row['vs_tf_fp32']:.2f}x TF fp32" if tf else "(no TF figure)"
                print(f"{name} {nproc} proc  {contender:<24} {row['samples_per_sec']:7.0f} samples/s  {versus}   {row['choice']}")
    for layout, table in results["runs"].get("1", {}).get("profile", {}).items():
        print(f"W2 fp32 step, {layout}: " + ", ".join(f"{k} {ms:.0f} ms" for k, ms in table[:5]))
    print(f"saved {save('fast_path', results)}")
    plot(results, tf_fp32, RESULTS / "fast_path.png")


def _measure_tf(rates: dict[str, list[float]], nproc: int, tmp: Path) -> None:
    """One TensorFlow run of each workload on ``nproc`` workers sharing the cores as loom's processes do."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    for name in rates:
        rates[name].append(launch("tensorflow", name, TF_STEPS[name], tmp / f"tf-{name}-{nproc}.json", tf_workers=nproc, tf_threads=threads))


def plot(results: dict, tf_fp32: dict[tuple[str, int], float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(name, nproc) for nproc in results["runs"] for name in WORKLOADS]
    fig, axis = plt.subplots(figsize=(10, 4.5))
    width = 0.2
    for i, contender in enumerate(CONTENDERS):
        axis.bar([g + i * width for g in range(len(groups))], [results["runs"][n][w][contender]["samples_per_sec"] for w, n in groups], width, label=contender)
    tf = [tf_fp32.get((w, int(n)), 0) for w, n in groups]
    label = "TF 2.21 fp32 (this run)" if results["tf_measured_here"] else "TF 2.21 fp32 (issue 15)"
    axis.bar([g + 3 * width for g in range(len(groups))], tf, width, label=label, color="gray")
    axis.set_xticks([g + 1.5 * width for g in range(len(groups))], [f"{w}, {n} proc" for w, n in groups])
    axis.set(ylabel="samples/s", title=f"CPU compute fast path (2 cores, load {results['load_average'][0]:.1f})")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
