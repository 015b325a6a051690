"""What recording collectives costs: a loop of small gloo all-reduces with and without loom's record.

The record is torch's flight recorder (``TORCH_FR_BUFFER_SIZE``) plus loom's call-site stamp
on each ``torch.distributed`` call. Two ranks, 1,000-float all-reduces (the cheapest real
collective, so the worst case for a fixed per-call cost), each configuration in fresh
processes, alternated. Also the stamp alone, around a no-op, in one process.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS = 2000
RESULTS = Path(__file__).parent / "results"


def _rank(rank: int, port: int, record: bool, out: mp.Queue) -> None:
    if record:
        from loom.diagnostics import collective_log

        collective_log.arm()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(1000)
    for _ in range(200):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        dist.all_reduce(t)
    dist.barrier()
    if rank == 0:
        out.put((time.perf_counter() - start) / CALLS * 1e6)
    dist.destroy_process_group()


def _loop(record: bool, port: int) -> float:
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, record, out)) for r in range(2)]
    for p in procs:
        p.start()
    value = out.get(timeout=300)
    for p in procs:
        p.join()
    return value


def _stamp_alone() -> float:
    from loom.diagnostics.collective_log import _stamped

    def noop(*args):
        return None

    stamped = _stamped(noop)
    best = {}
    for name, fn in (("plain", noop), ("stamped", stamped)):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(100_000):
                fn(1)
            times.append((time.perf_counter() - start) / 100_000 * 1e6)
        best[name] = min(times)
    return best["stamped"] - best["plain"]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    plain, recorded = [], []
    for i in range(rounds):
        plain.append(_loop(False, 29700 + 2 * i))
        recorded.append(_loop(True, 29701 + 2 * i))
    result = {
        "calls_per_round": CALLS, "rounds": rounds,
        "raw_pytorch_us_per_all_reduce": plain, "loom_recorded_us_per_all_reduce": recorded,
        "median_ratio": statistics.median(recorded) / statistics.median(plain),
        "stamp_alone_us": _stamp_alone(),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "collective_record.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["raw PyTorch", "loom record on"], [statistics.median(plain), statistics.median(recorded)])
    ax.set_ylabel("µs per 1,000-float all-reduce (2 gloo ranks)")
    fig.tight_layout()
    fig.savefig(RESULTS / "collective_record.png")


if __name__ == "__main__":
    main()
