"""loom at its defaults against plain eager PyTorch on the CPU, W1 and W2, as ratios from one interleaved run.

    python bench/fast_path.py [--nproc 1 2] [--rounds 3] [--steps 5] [--trial]

Each contender runs in processes of its own, as a user's script would, so that a process-wide
setting (the allocator) is measured as it is used:

- ``plain eager``: hand-written PyTorch, ``python`` for one process, ``torchrun`` and
  ``DistributedDataParallel`` for two (glibc's allocator as it comes);
- ``loom defaults``: ``loom run --nproc N`` and ``strategy.prepare(model, opt)``, nothing else
  (the exact fast path: glibc tunables from the launcher, ``pool_before_relu``, ``pool_nhwc``);
- ``loom fast_path=True`` (with ``--trial``): the inexact candidates too, chosen by the trial on
  the first batch (the choice's line is kept).

Every round runs each contender once, in an order rotated from round to round, so that the
machine's slow spells fall on all of them; each run times ``--steps`` steps after 3 warm-up steps,
and the median over the rounds is kept. A ratio is loom's median over plain eager's, from the
same run; so is the median of each round's own ratio, which a load drifting between rounds moves
less. Each process also reports its peak resident memory (the allocator keeps its heap at its
peak: the cost of ``reuse_memory``). TensorFlow 2.21 (``bench/peers/tf_peer.py``) joins the
rounds when ``.venv-tf`` exists (``make bench-tf``). Writes bench/results/fast_path.json and .png.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.peers.run import launch, missing  # noqa: E402
from bench.workloads import RESULTS, WORKLOADS, endless, machine, save, sgd_step  # noqa: E402

WARMUP = 3
TF_STEPS = {"W1": 20, "W2": 10}


def worker(contender: str, name: str, steps: int, out: str) -> None:
    """One contender's run of a workload in this process (one of ``nproc``): samples/s, peak RSS, loom's lines."""
    workload = WORKLOADS[name]
    data = workload.data(batches=4)
    said = io.StringIO()
    if contender == "plain eager":
        step, rank = _plain(workload, data)
    else:
        import loom

        strategy = loom.auto_strategy(timeout=600)
        loader = strategy.distribute(data, batch_size=workload.global_batch)
        options = {"fast_path": True, "example_input": next(iter(loader))[0]} if contender == "loom fast_path=True" else {}
        torch.manual_seed(0)
        with redirect_stdout(said), redirect_stderr(said):
            model, opt = strategy.prepare(workload.build(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), **options)
        step, rank = sgd_step(model, opt, endless(loader), strategy.backward), strategy.replica_id
    for _ in range(WARMUP):
        step()
    _barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _barrier()
    seconds = time.perf_counter() - start
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        lines = [line for line in said.getvalue().splitlines() if line.startswith("loom: fast path")]
        Path(out).write_text(json.dumps({"samples_per_sec": steps * workload.global_batch / seconds, "peak_rss_mb": peak.item(), "lines": lines}))


def _plain(workload, data):
    """Hand-written PyTorch: the model, SGD with momentum, and DDP over this process's share when several."""
    torch.manual_seed(0)
    model = workload.build()
    rank, world = 0, 1
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    local = workload.global_batch // world
    x, y = data.tensors
    batches = [(x[i + rank * local : i + (rank + 1) * local], y[i + rank * local : i + (rank + 1) * local]) for i in range(0, len(x), workload.global_batch)]
    return sgd_step(model, opt, endless(batches), lambda loss: loss.backward()), rank


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def command(contender: str, nproc: int, name: str, steps: int, out: Path) -> list[str]:
    me = [__file__, "--worker", contender, "--workload", name, "--steps", str(steps), "--out", str(out)]
    if contender != "plain eager":
        return [sys.executable, "-m", "loom.launch.cli", "run", "--nproc", str(nproc), "--timeout", "900", *me]
    if nproc == 1:
        return [sys.executable, *me]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *me]


def run_one(contender: str, nproc: int, name: str, steps: int, tmp: Path) -> dict:
    out = tmp / f"{contender}-{nproc}-{name}.json".replace(" ", "_")
    if contender == "tensorflow":
        rate = launch("tensorflow", name, TF_STEPS[name], out, tf_workers=nproc, tf_threads=max(1, (os.cpu_count() or 1) // nproc))
        return {"samples_per_sec": rate}
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    done = subprocess.run(command(contender, nproc, name, steps, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{contender} --nproc {nproc} {name} failed: {done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trial", action="store_true", help="also loom with fast_path=True (the inexact candidates' trial)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.workload, args.steps, args.out)
    contenders = ["plain eager", "loom defaults"] + (["loom fast_path=True"] if args.trial else [])
    no_tf = missing("tensorflow")
    contenders += [] if no_tf else ["tensorflow"]
    print(f"TensorFlow not measured: {no_tf}" if no_tf else "TensorFlow measured in this run", flush=True)
    configs = [(nproc, name, c) for nproc in args.nproc for name in args.workloads for c in contenders]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            shift = r * len(contenders) // max(args.rounds, 1)
            for nproc, name in dict.fromkeys((n, w) for n, w, _ in configs):
                for contender in contenders[shift:] + contenders[:shift]:
                    row = run_one(contender, nproc, name, args.steps, Path(tmp))
                    runs.setdefault(f"{name} {nproc} {contender}", []).append(row)
                    print(f"round {r + 1}: {name} {nproc} proc {contender:<20} {row['samples_per_sec']:8,.0f} samples/s", flush=True)
    table = summary(runs, contenders, args)
    results = {"machine": machine(), "load_average": os.getloadavg(), "rounds": args.rounds, "steps": args.steps, "runs": runs, "summary": table}
    print(f"saved {save('fast_path', results)}")
    plot(table, RESULTS / "fast_path.png")


def summary(runs: dict[str, list[dict]], contenders: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Median samples/s, ratio to plain eager and peak RSS per configuration; printed as a table."""
    table: dict[str, dict] = {}
    for nproc in args.nproc:
        for name in args.workloads:
            plain = statistics.median(row["samples_per_sec"] for row in runs[f"{name} {nproc} plain eager"])
            for contender in contenders:
                rows = runs[f"{name} {nproc} {contender}"]
                rate = statistics.median(row["samples_per_sec"] for row in rows)
                rss = [row["peak_rss_mb"] for row in rows if "peak_rss_mb" in row]
                pairs = [row["samples_per_sec"] / base["samples_per_sec"] for row, base in zip(rows, runs[f"{name} {nproc} plain eager"])]
                entry = {
                    "samples_per_sec": rate, "vs_plain": rate / plain, "vs_plain_by_round": pairs, "vs_plain_paired": statistics.median(pairs),
                    "peak_rss_mb": statistics.median(rss) if rss else None, "lines": rows[-1].get("lines", []),
                }  # fmt: skip
                table[f"{name} {nproc} {contender}"] = entry
                memory = f"peak RSS {entry['peak_rss_mb']:6.0f} MB" if rss else ""
                paired = f"(median of each round's ratio {entry['vs_plain_paired']:.2f}x, {min(pairs):.2f}-{max(pairs):.2f}x)"
                print(f"{name} {nproc} proc  {contender:<20} {rate:8,.0f} samples/s  {rate / plain:5.2f}x plain eager {paired}  {memory}  {' | '.join(entry['lines'])}")
    return table


def plot(table: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(" ".join(key.split()[:2]) for key in table))
    contenders = list(dict.fromkeys(" ".join(key.split()[2:]) for key in table))
    fig, axis = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(contenders)
    for i, contender in enumerate(contenders):
        axis.bar([g + i * width for g in range(len(groups))], [table[f"{g} {contender}"]["vs_plain"] for g in groups], width, label=contender)
    axis.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{g.split()[0]}, {g.split()[1]} proc" for g in groups])
    axis.set(ylabel="samples/s over plain eager", title="loom at its defaults against plain eager PyTorch (CPU)")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
