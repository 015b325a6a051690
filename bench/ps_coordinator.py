"""TF's parameter-server tutorial shape under ClusterCoordinator against loom's per-worker loop.

    python bench/ps_coordinator.py [--steps 200] [--rounds 3]

The model and data are examples/tf_parameter_server.py's (an embedding of 8 words x 16,384,
averaged over 3 words, a sigmoid unit, batch 32, Adagrad on the servers). Both ways train on
2 servers with 2 workers that run steps, on this machine:

- ``coordinator``: ``loom run --ps 2 --workers 3``, the chief scheduling ``--steps`` steps with
  ``coordinator.schedule(step_fn, args=(per_worker_iterator,))`` and joining;
- ``per-worker loop``: ``loom run --ps 2 --workers 2``, each worker running half the steps in its
  own loop (the usual ParameterServerStrategy way).

Each run meets at a barrier, runs 10 warm-up steps, then times ``--steps`` steps (the launch
and start-up are not timed): samples/s over the timed steps, from the first worker's start to
the last one's end (the chief's window under the coordinator), and the CPU time the training
processes spent per step (the chief's included, the servers' not: less sensitive to a shared
machine's load than samples/s). The ways run interleaved, ``--rounds`` times; the medians are
kept, with their ratios, and the 1-minute load average after each run. TensorFlow's ParameterServerStrategy (its tutorial's in-process cluster, same
shape) runs too where ``import tensorflow`` works in ``.venv-tf`` or this Python; it is
left out, and the JSON says so, where it does not. Saves ``results/ps_coordinator.json`` and
``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workloads import RESULTS, save  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TF_PYTHON = ROOT / ".venv-tf" / "bin" / "python"
BATCH, WORDS, VOCAB, WIDTH, WARMUP = 32, 3, 8, 16384, 10


# ---- one process of a loom job (run by ``loom run``) ---------------------------------------------
def _batches(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.stack([torch.randperm(VOCAB - 1, generator=g)[:WORDS] + 1 for _ in range(BATCH)])
        yield ids, (ids != 1).all(1).float()  # "yes" (0) when "avenger" (1) is among the words


def _model_and_step(strategy):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb_layer = nn.Embedding(VOCAB, WIDTH)
            self.dense = nn.Linear(WIDTH, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.dense(self.emb_layer(ids).mean(1))).squeeze(1)

    with strategy.scope():
        model = Model()
    model, optimizer = strategy.prepare(model, lambda params: torch.optim.Adagrad(params, lr=0.001))

    def step_fn(iterator):
        ids, labels = next(iterator)
        loss = F.binary_cross_entropy(model(ids), labels)
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step_fn


def job(way: str, steps: int, out: str) -> None:
    import loom

    strategy = loom.ParameterServerStrategy()
    step_fn = _model_and_step(strategy)
    if way == "coordinator":
        coordinator = loom.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(lambda ctx: _batches(ctx.input_pipeline_id)))
        strategy.barrier()
        for _ in range(WARMUP):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        start, cpu = time.time(), time.process_time()  # on every process: the workers run the steps in join()
        for _ in range(steps):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        _record(out, start, time.time(), steps if strategy.is_chief else 0, time.process_time() - cpu)
        return
    iterator, mine = _batches(strategy.worker), steps // strategy.num_workers + (strategy.worker < steps % strategy.num_workers)
    strategy.barrier()
    for _ in range(WARMUP):
        step_fn(iterator)
    strategy.barrier()
    start, cpu = time.time(), time.process_time()
    for _ in range(mine):
        step_fn(iterator)
    _record(out, start, time.time(), mine, time.process_time() - cpu)


def _record(out: str, start: float, end: float, steps: int, cpu: float) -> None:
    with open(out, "a") as f:
        f.write(json.dumps({"start": start, "end": end, "samples": steps * BATCH, "cpu": cpu}) + "\n")


# ---- the driver -----------------------------------------------------------------------------------
def run_loom(way: str, steps: int) -> tuple[float, float]:
    """Samples/s of one loom job, and the CPU milliseconds its training processes spent per step
    (the chief's included; the servers' not)."""
    workers = 3 if way == "coordinator" else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.jsonl")
        command = [sys.executable, "-m", "loom.launch.cli", "run", "--ps", "2", "--workers", str(workers),
                   __file__, "--job", way, "--steps", str(steps), "--out", out]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"{way} failed:\n{done.stderr[-3000:]}")
        lines = [json.loads(line) for line in Path(out).read_text().splitlines()]
    timed = [r for r in lines if r["samples"]]  # a coordinator job: the chief's window
    rate = sum(r["samples"] for r in timed) / (max(r["end"] for r in timed) - min(r["start"] for r in timed))
    return rate, sum(r["cpu"] for r in lines) / steps * 1e3


def tensorflow_python() -> str | None:
    """A Python where ``import tensorflow`` works, or None."""
    for python in (str(TF_PYTHON), sys.executable):
        if Path(python).exists() and subprocess.run([python, "-c", "import tensorflow"], capture_output=True).returncode == 0:
            return python
    return None


def run_tensorflow(python: str, steps: int) -> tuple[float, float | None]:
    done = subprocess.run([python, str(Path(__file__).with_name("tf_ps_coordinator.py")), str(steps)], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"tensorflow failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["samples_per_sec"], None  # one process: no CPU split


def plot(results: dict, path: Path) -> None:
    """Median samples/s and CPU ms per step of each way, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["median"])
    cpu = {n: statistics.median(v) for n, v in results["cpu_ms_per_step"].items() if None not in v}
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    colors = ["#4c72b0", "#dd8452", "#55a868"]
    left.bar_label(left.barh(names, [results["median"][n] for n in names], color=colors[: len(names)]), fmt="%.0f")
    left.set_xlabel("samples/s (median)")
    right.bar_label(right.barh(list(cpu), list(cpu.values()), color=colors[: len(cpu)]), fmt="%.1f")
    right.set_xlabel("CPU ms per step, training processes (median)")
    right.set_yticks([])
    fig.suptitle(f"TF's PS tutorial shape, 2 servers, 2 workers running steps: {results['rounds']} interleaved rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run (after 10 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way, interleaved; medians kept")
    parser.add_argument("--job", choices=("coordinator", "loop"), help=argparse.SUPPRESS)  # one process of a loom job
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args.job, args.steps, args.out)
    python = tensorflow_python()
    ways = {"loom ClusterCoordinator": lambda: run_loom("coordinator", args.steps), "loom per-worker loop": lambda: run_loom("loop", args.steps)}
    if python:
        ways["TF ParameterServerStrategy"] = lambda: run_tensorflow(python, args.steps)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    loads = [os.getloadavg()[0]]
    for round_ in range(args.rounds):
        for name, run in ways.items():
            rate, used = run()
            rates[name].append(rate)
            cpu[name].append(used)
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1}: {name}: {rate:.0f} samples/s" + (f", {used:.1f} CPU ms/step" if used else ""), flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["loom ClusterCoordinator"] / medians["loom per-worker loop"]
    cpu_ratio = statistics.median(cpu["loom ClusterCoordinator"]) / statistics.median(cpu["loom per-worker loop"])
    print(f"ClusterCoordinator / per-worker loop: {ratio:.2f} (samples/s), {cpu_ratio:.2f} (CPU per step)")
    results = {"steps": args.steps, "rounds": args.rounds, "batch": BATCH, "samples_per_sec": rates, "median": medians,
               "coordinator_over_loop": ratio, "cpu_ms_per_step": cpu, "coordinator_over_loop_cpu": cpu_ratio,
               "cores": os.cpu_count(), "load_average_1min": loads,
               "tensorflow": "ran" if python else "not installed here (import tensorflow failed): left out"}  # fmt: skip
    if python:
        results["coordinator_over_tensorflow"] = medians["loom ClusterCoordinator"] / medians["TF ParameterServerStrategy"]
    print(f"saved {save('ps_coordinator', results)}")
    plot(results, RESULTS / "ps_coordinator.png")


if __name__ == "__main__":
    main()
