"""What recording collectives costs: a loop of small gloo all-reduces with and without loom's record.

The record is torch's flight recorder (``TORCH_FR_BUFFER_SIZE``) plus loom's call-site stamp
on each ``torch.distributed`` call. Two ranks, 1,000-float all-reduces (the cheapest real
collective, so the worst case for a fixed per-call cost). The recorder is set per process,
so it is measured in a second pair of processes; the stamp is switched on and off in blocks
inside each pair, and the fastest block of each mode counts (the machine is shared).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BLOCKS, CALLS = 30, 100  # blocks alternate between modes; the fastest block of each mode counts
RESULTS = Path(__file__).parent / "results"


def _rank(rank: int, port: int, recorder: bool, out: mp.Queue) -> None:
    from loom.comm import collective_log

    if recorder:
        collective_log.arm_workers()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    raw, stamped = dist.all_reduce, collective_log._stamped(dist.all_reduce)
    t = torch.ones(1000)
    for _ in range(200):
        raw(t)
    best = {"raw": float("inf"), "stamped": float("inf")}
    for block in range(BLOCKS):
        for mode, fn in (("raw", raw), ("stamped", stamped)) if block % 2 else (("stamped", stamped), ("raw", raw)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn(t)
            best[mode] = min(best[mode], (time.perf_counter() - start) / CALLS * 1e6)
    if rank == 0:
        out.put(best)
    dist.destroy_process_group()


def _pair(recorder: bool, port: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, recorder, out)) for r in range(2)]
    for p in procs:
        p.start()
    value = out.get(timeout=600)
    for p in procs:
        p.join()
    return value


def _one_process(out: mp.Queue) -> None:
    """The stamp alone around a one-rank all-reduce: no peer, so no cross-process scheduling noise."""
    from loom.comm import collective_log

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29715", rank=0, world_size=1)
    raw, stamped = dist.all_reduce, collective_log._stamped(dist.all_reduce)
    t, best = torch.ones(1000), {"raw": float("inf"), "stamped": float("inf")}
    for block in range(BLOCKS):
        for mode, fn in (("raw", raw), ("stamped", stamped)) if block % 2 else (("stamped", stamped), ("raw", raw)):
            start = time.perf_counter()
            for _ in range(CALLS):
                fn(t)
            best[mode] = min(best[mode], (time.perf_counter() - start) / CALLS * 1e6)
    out.put(best)
    dist.destroy_process_group()


def main() -> None:
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    single = ctx.Process(target=_one_process, args=(queue,))
    single.start()
    one = queue.get(timeout=600)
    single.join()
    off, on = _pair(False, 29711), _pair(True, 29713)
    result = {
        "what": "us per 1,000-float gloo all-reduce, 2 ranks, fastest of 30 blocks of 100 calls per mode",
        "raw_pytorch": off["raw"],
        "flight_recorder_only": on["raw"],
        "stamp_only": off["stamped"],
        "loom_record (flight recorder + stamp)": on["stamped"],
        "ratio_loom_record_to_raw": on["stamped"] / off["raw"],
        "one_rank_raw": one["raw"],
        "one_rank_stamped": one["stamped"],
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "collective_record.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = ["raw_pytorch", "flight_recorder_only", "stamp_only", "loom_record (flight recorder + stamp)"]
    ax.barh(names, [result[n] for n in names])
    ax.set_xlabel("µs per 1,000-float all-reduce (2 gloo ranks)")
    fig.tight_layout()
    fig.savefig(RESULTS / "collective_record.png")


if __name__ == "__main__":
    main()
