"""What keeping every acknowledged update costs a parameter-server job: steps/s with and without the log.

    python bench/ps_durability.py [--steps 100] [--workers 2] [--repeats 3]

Two servers, each a process of its own, and ``--workers`` worker processes on loopback, training
two models: the small click model of the tests (a push is a few KB) and a dense MLP of 1M
parameters (a push is 4 MB). Each server runs in one of three ways:

* ``none``: no state file, so no log and no snapshots (a restarted server has lost everything);
* ``log``: the write-ahead log, each record written before the reply, not fsync'd (survives
  ``kill -9`` of the server, not a power cut of the machine);
* ``log+fsync``: what ``loom run --ps`` does: each record fsync'd before the reply (requests
  arriving together share one fsync).

Workers train asynchronously and synchronously (``--sync``). Prints and saves the job's steps/s
(all workers' steps per second of wall time, over the timed steps; the dense model runs a
quarter of the steps), the median of ``--repeats`` runs taken in turn (the three ways
alternate, so a busy moment of the machine does not fall on one way only), and each way's
rate against ``none``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workloads import save  # noqa: E402

MODES = ("none", "log", "log+fsync")
WARMUP = 10
TOKEN = "bench"


class Dense(nn.Module):
    """1M parameters in two layers: a 4 MB push a step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 960), nn.ReLU(), nn.Linear(960, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def _serve(mode: str, path: str, port: int, ready: multiprocessing.Event, stop: multiprocessing.Event) -> None:
    from loom.strategies.parameter_server.server import ParameterServer

    torch.set_num_threads(1)
    server = ParameterServer(TOKEN) if mode == "none" else ParameterServer.recover(TOKEN, path, durable=mode == "log+fsync")[0]
    server.serve(port)
    ready.set()
    stop.wait()
    server.stop()


def _work(model_name: str, servers: list[str], worker: int, workers: int, sync: bool, steps: int, out: multiprocessing.Queue) -> None:
    from loom.strategies.parameter_server.strategy import ParameterServerStrategy
    from tests.scripts.clicks import Clicks

    torch.set_num_threads(1)
    strategy = ParameterServerStrategy(servers, token=TOKEN, worker=worker, num_workers=workers, synchronous=sync)
    if model_name == "clicks":
        model, opt = strategy.prepare(Clicks(rows=1000), lambda p: torch.optim.Adagrad(p, lr=0.1))
    else:
        model, opt = strategy.prepare(Dense(), lambda p: torch.optim.SGD(p, lr=0.01))
    g = torch.Generator().manual_seed(worker)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            start = time.perf_counter()
        if model_name == "clicks":
            x = torch.randint(0, 1000, (32, 5), generator=g)
            y = (x % 7 == 0).any(1).float()
        else:
            x = torch.randn(32, 64, generator=g)
            y = (x[:, 0] > 0).float()
        F.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out.put(steps / (time.perf_counter() - start))
    strategy.shutdown()


def run(mode: str, model: str, sync: bool, workers: int, steps: int) -> float:
    """The job's steps/s (every worker's, summed) with servers run in ``mode``."""
    from tests.helpers import free_port

    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as state:  # the repository's disk, not a tmpfs
        ports = [free_port() for _ in range(2)]
        servers = []
        for index, port in enumerate(ports):
            ready = ctx.Event()
            servers.append(ctx.Process(target=_serve, args=(mode, f"{state}/server-{index}.safetensors", port, ready, stop)))
            servers[-1].start()
            ready.wait(60)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        procs = [ctx.Process(target=_work, args=(model, addresses, w, workers, sync, steps, out)) for w in range(workers)]
        for p in procs:
            p.start()
        rates = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        stop.set()
        for s in servers:
            s.join()
    return sum(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    runs: dict[str, dict[str, list[float]]] = {}
    for model in ("clicks", "dense-4MB"):
        for sync in (False, True):
            name = f"{model} {'sync' if sync else 'async'}"
            steps = args.steps if model == "clicks" else args.steps // 4
            runs[name] = {mode: [] for mode in MODES}
            for _ in range(args.repeats):
                for mode in MODES:
                    runs[name][mode].append(run(mode, model, sync, args.workers, steps))
            results[name] = {mode: statistics.median(rates) for mode, rates in runs[name].items()}
            base = results[name]["none"]
            print(f"{name:>18}: " + "  ".join(f"{m} {r:7.1f} steps/s ({r / base:5.2f}x)" for m, r in results[name].items()), flush=True)
    summary = {"workers": args.workers, "steps": args.steps, "repeats": args.repeats, "steps_per_sec": results, "runs": runs}
    print(f"saved {save('ps_durability', summary)}")


if __name__ == "__main__":
    main()
