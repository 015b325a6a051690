"""Sparse model W3: parameter servers against all-reduce, samples/s and bytes on the wire.

    python bench/parameter_server.py [--workers 2 4] [--steps 30] [--servers 2]
    python bench/parameter_server.py --tls-ratio --methods parameter-server --workers 2 --repeats 3

W3: EmbeddingBag(1,000,000 x 32, sum) over bags of 20 ids drawn from a Zipf distribution
(exponent 1.1, as ids in click logs are), then an MLP 32-64-1; global batch 1024. Three ways
to train it on the same data:

* loom ParameterServerStrategy, 2 servers by default (workers pull only the rows their batch touches),
  asynchronous, and synchronous (``--sync``: each step the servers apply the workers' mean),
  each also with ``strategy.prefetch`` (the next batch's rows come in the reply to the step's
  commit, or to the read after a synchronous round: one round trip a step fewer);
* MirroredStrategy, all-reducing the dense 128 MB embedding gradient every step;
* DDP with sparse embedding gradients (``EmbeddingBag(sparse=True)``; gloo all-gathers them).

Bytes sent plus received per worker per step are measured, not computed: for the all-reduce
jobs on the wire (each job runs in a network namespace of its own, whose loopback counters
are exactly its traffic, read over the timed steps); for the parameter servers at the
transport (the size of every gRPC message a worker sent and received). Where namespaces
cannot be made, the run says so and stops. With 4 workers it also slows one of them 4x (a
sleep of three step times) and reports how much throughput each method keeps. Each worker
reports how much its peak resident memory grew from before the model was built (the table is
128 MB); parameter-server workers build the model under ``strategy.scope()``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workloads import RESULTS, save  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ROWS, DIM, BAG, GLOBAL_BATCH = 1_000_000, 32, 20, 1024
METHODS = ("parameter-server", "parameter-server-prefetch", "parameter-server-sync", "parameter-server-sync-prefetch", "mirrored-dense", "sparse-ddp")


class W3(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids)).squeeze(1)


def batch(step: int, worker: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zipf(1.1) ids folded into the table, the same for every method at the same step and worker."""
    rng = np.random.default_rng(step * 1_000 + worker)
    ids = torch.from_numpy((rng.zipf(1.1, size=(size, BAG)) - 1) % ROWS)
    return ids, (ids % 5 == 0).float().mean(1).gt(0.2).float()


def worker_main(method: str, steps: int, out: str) -> None:
    import loom

    strategy = loom.auto_strategy()
    workers = strategy.num_replicas_in_sync
    size = GLOBAL_BATCH // workers
    rank = strategy.replica_id
    # Every batch is drawn before the first step: drawn between steps, an asynchronous worker's
    # drawing would run beside the other workers' timed steps (lockstep workers draw together).
    batches = [batch(step, rank, size) for step in range(steps + 4)]
    rss_before = _peak_rss()  # after the batches: the growth is the model's and the method's
    if method.startswith("parameter-server"):
        with strategy.scope():  # the table is never built on a worker: the servers draw it
            model = W3()
    else:
        model = W3(sparse=method == "sparse-ddp")
    if method == "sparse-ddp":  # plain DDP on loom's process group: Mirrored does not take sparse gradients
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model, opt = strategy.prepare(model, lambda p: torch.optim.SGD(p, lr=0.1))
    times, wire, transport = [], 0, 0
    straggle = float(os.environ.get("LOOM_BENCH_STRAGGLER_SLEEP", "0")) if rank == 3 else 0.0
    prefetch = method.endswith("-prefetch")
    for step in range(steps + 3):
        if step == 3:  # after warm-up (and, for the PS, after the chief sent the initial table)
            wire = _lo_bytes()
            transport = strategy.variables.bytes_moved if method.startswith("parameter-server") else 0
        (ids, y), upcoming = batches[step], batches[step + 1]
        start = time.perf_counter()
        if prefetch:  # the next batch's rows, brought by this step's commit
            strategy.prefetch(model, {"bag": upcoming[0]})
        F.binary_cross_entropy_with_logits(model(ids), y).backward()
        if straggle:  # the straggler: a slow machine (no sleep(0) for the others: it hands the GIL away)
            time.sleep(straggle)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    wire = _lo_bytes() - wire
    transport = (strategy.variables.bytes_moved if method.startswith("parameter-server") else 0) - transport
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"seconds": times[3:], "samples": size * steps, "wire": wire, "transport": transport,
                   "peak_rss_growth": _peak_rss() - rss_before}, f)  # fmt: skip


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _lo_bytes() -> int:
    """Bytes sent on loopback in this network namespace (each is also received there)."""
    text = Path("/proc/net/dev").read_text()
    return int(next(line for line in text.splitlines() if line.strip().startswith("lo:")).split(":")[1].split()[8])


def run(method: str, workers: int, steps: int, tmp: Path, straggler_sleep: float = 0.0, servers: int = 2, tls: bool = False) -> dict[str, float]:
    """One job in a network namespace of its own; ``tls``: its servers and workers speak mutual TLS,
    as a job across machines does (certificates for 127.0.0.1 from a job authority)."""
    namespace = f"loombench{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"], check=True)
        out = tmp / f"{method}-{workers}-{straggler_sleep:g}{'-tls' if tls else ''}"
        launch = ["--ps", str(servers), "--workers", str(workers)] if method.startswith("parameter-server") else ["--nproc", str(workers)]
        launch += ["--sync"] if method.startswith("parameter-server-sync") else []
        command = [sys.executable, "-m", "loom.launch.cli", "run", *launch, __file__, "--worker", method, "--steps", str(steps), "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "LOOM_BENCH_STRAGGLER_SLEEP": str(straggler_sleep)}
        if tls:
            from loom.launch.certificates import task_certificate

            env.update(task_certificate("bench", "127.0.0.1", tmp / f"tls-{method}-{workers}"))
        done = subprocess.run(["ip", "netns", "exec", namespace, *command], capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode:
            raise RuntimeError(f"{method} x{workers} failed: {done.stderr[-2000:]}")
    finally:
        subprocess.run(["ip", "netns", "del", namespace])
    reports = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(workers)]
    step_seconds = max(float(np.median(r["seconds"])) for r in reports)  # the slowest worker sets the pace in sync runs
    # Samples over the time the timed steps took, for every method: a median step would leave out
    # the slow steps a lockstep job has, and the asynchronous workers' rate counts every step.
    if method in ("parameter-server", "parameter-server-prefetch"):  # asynchronous: each worker at its own pace
        rate = sum(r["samples"] / sum(r["seconds"]) for r in reports)
    else:  # in lockstep: the slowest worker's time is the job's
        rate = GLOBAL_BATCH * steps / max(sum(r["seconds"]) for r in reports)
    median_rate = sum(r["samples"] / steps / float(np.median(r["seconds"])) for r in reports)  # kept for reference
    if method.startswith("parameter-server"):  # at the transport: what each worker sent plus received
        per_worker_step = float(np.mean([r["transport"] for r in reports])) / steps
    else:  # on the wire, in lockstep: every byte is sent by one worker and received by another
        per_worker_step = 2 * reports[0]["wire"] / workers / steps
    growth = max(r["peak_rss_growth"] for r in reports)  # the worker whose peak memory grew most
    return {"samples_per_sec": rate, "samples_per_sec_at_median_step": median_rate, "bytes_per_worker_step": per_worker_step, "step_seconds": step_seconds, "peak_rss_growth": growth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--servers", type=int, default=2, help="parameter servers (the table is split among them)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each method, interleaved; the median is kept")
    parser.add_argument("--tls-ratio", action="store_true", help="run only the parameter-server methods, with TLS and without: throughput ratio")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.steps, args.out)
        return
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        sys.exit("bench/parameter_server.py measures bytes in network namespaces; it needs root and iproute2")
    import tempfile

    if args.tls_ratio:
        tls_ratio(args)
        return
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            runs: dict[str, list[dict[str, float]]] = {}
            for _ in range(args.repeats):
                for method in args.methods:
                    runs.setdefault(method, []).append(run(method, workers, args.steps, Path(tmp), servers=args.servers))
            for method, rows in runs.items():
                row = sorted(rows, key=lambda r: r["samples_per_sec"])[len(rows) // 2]
                results.setdefault(method, {})[str(workers)] = {**row, "repeats": [r["samples_per_sec"] for r in rows]}
                print(f"{method:<21} {workers} workers: {row['samples_per_sec']:9,.0f} samples/s  "
                      f"{row['bytes_per_worker_step'] / 2**20:8.2f} MB per worker per step  "
                      f"worker peak memory +{row['peak_rss_growth'] / 2**20:.0f} MB", flush=True)  # fmt: skip
    baselines = {"mirrored-dense", "sparse-ddp"} <= set(args.methods)  # the ratios need both in the same run
    for workers in map(str, args.workers) if baselines else ():
        dense, sparse = results["mirrored-dense"][workers], results["sparse-ddp"][workers]
        for method in [m for m in args.methods if m.startswith("parameter-server")]:
            ps = results[method][workers]
            print(f"{workers} workers, {method}: vs dense all-reduce {ps['samples_per_sec'] / dense['samples_per_sec']:.1f}x throughput, "
                  f"{dense['bytes_per_worker_step'] / ps['bytes_per_worker_step']:.0f}x fewer bytes; "
                  f"vs sparse DDP {ps['samples_per_sec'] / sparse['samples_per_sec']:.2f}x throughput, "
                  f"{sparse['bytes_per_worker_step'] / ps['bytes_per_worker_step']:.1f}x fewer bytes")  # fmt: skip
    if 4 in args.workers and {"parameter-server", "parameter-server-sync", "sparse-ddp"} <= set(args.methods):
        results["straggler"] = straggler(results, args.steps, args.servers)
    results["servers"] = args.servers
    name = "parameter_server" if set(args.methods) == set(METHODS) else "parameter_server_some"  # a partial run keeps the full one
    print(f"saved {save(name, results)}")
    plot({k: v for k, v in results.items() if k not in ("straggler", "servers")}, RESULTS / f"{name}.png")


def tls_ratio(args: argparse.Namespace) -> None:
    """Throughput of each parameter-server method with mutual TLS over without, runs interleaved, medians kept."""
    import tempfile

    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            for method in [m for m in args.methods if m.startswith("parameter-server")]:
                rates: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(args.repeats):
                    for tls in (False, True):
                        rates[tls].append(run(method, workers, args.steps, Path(tmp), servers=args.servers, tls=tls)["samples_per_sec"])
                clear, secure = (float(np.median(rates[tls])) for tls in (False, True))
                results.setdefault(method, {})[str(workers)] = {"clear": clear, "tls": secure, "ratio": secure / clear, "repeats": {"clear": rates[False], "tls": rates[True]}}
                print(f"{method:<21} {workers} workers: {clear:9,.0f} samples/s clear, {secure:9,.0f} with TLS: ratio {secure / clear:.3f}", flush=True)
    print(f"saved {save('parameter_server_tls', results)}")


def straggler(results: dict, steps: int, servers: int) -> dict[str, dict[str, float]]:
    """One of 4 workers slowed 4x (a sleep of 3 step times): who keeps their pace."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("parameter-server", "parameter-server-sync", "sparse-ddp"):
            quiet = results[method]["4"]
            slowed = run(method, 4, steps, Path(tmp), straggler_sleep=3 * quiet["step_seconds"], servers=servers)
            kept = slowed["samples_per_sec"] / quiet["samples_per_sec"]
            out[method] = {"samples_per_sec": slowed["samples_per_sec"], "kept": kept}
            print(f"straggler ({method}): {slowed['samples_per_sec']:9,.0f} samples/s, {kept:.0%} of its no-straggler throughput", flush=True)
    return out


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, rows in results.items():
        workers = [int(w) for w in rows]
        left.plot(workers, [rows[str(w)]["samples_per_sec"] for w in workers], marker="o", label=method)
        right.plot(workers, [rows[str(w)]["bytes_per_worker_step"] / 2**20 for w in workers], marker="o", label=method)
    left.set(xlabel="workers", ylabel="samples/s", title="W3 throughput")
    right.set(xlabel="workers", ylabel="MB sent+received per worker per step", title="W3 traffic (PS: at the transport)", yscale="log")
    for axis in (left, right):
        axis.set_xticks(sorted({int(w) for rows in results.values() for w in rows}))
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
