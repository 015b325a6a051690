"""Memory and throughput of ShardedStrategy against MirroredStrategy, and against FSDP2 written by hand.

Sharded runs twice: as it comes (gathering each block again for backward) and with
``reshard_after_forward=False`` (keeping it gathered from forward to backward). The times of
the collectives each strategy uses are measured too: on gloo, what sets their ratio. So is
each process's CPU time a step (all its threads, gloo's included): on a machine whose cores
are all busy, throughput follows it, and unlike wall time it barely moves with the load.

Two models of stacked 1024-wide (or 512-wide) linear blocks trained with AdamW, on 2 and 4
processes of one thread each: one whose parameters, gradients and Adam state (16 bytes a
parameter) fit in a process's memory budget, and one that fits only sharded. The budget is
simulated (``--budget-mb``): each process's peak resident memory added by building the
model and taking the steps is measured and compared with it. Peaks are taken with malloc's
mmap threshold fixed at 1 MiB, so freed tensors leave the resident size.

"Raw fully_shard" is FSDP2 as its tutorial writes it, with gloo's own reduce-scatter; Sharded
reduce-scatters by all-to-all on gloo (loom/strategies/model_parallel/fsdp_comms.py).

    python bench/sharded.py [--replicas 2 4] [--steps 5] [--budget-mb 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loom  # noqa: E402
from loom.launch import LaunchOptions, run_job  # noqa: E402
from workloads import RESULTS, machine, save  # noqa: E402

MODELS = {"fits": (8, 512), "too big unsharded": (24, 1024)}  # (blocks, width)
KINDS = ("mirrored", "sharded", "sharded, no reshard", "raw fully_shard")
PER_REPLICA_BATCH = 8


class Wide(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def loss_fn(out: torch.Tensor, _: Any) -> torch.Tensor:
    return out.square().mean()


def loom_run(kind: str, blocks: int, width: int) -> Callable[[torch.Tensor], None]:
    strategy = loom.MirroredStrategy() if kind == "mirrored" else loom.ShardedStrategy(reshard_after_forward=kind == "sharded")
    if kind != "mirrored":
        with strategy.scope():
            model = Wide(blocks, width)
    else:
        model = Wide(blocks, width)
    model, opt = strategy.prepare(model, lambda p: torch.optim.AdamW(p, lr=1e-4))
    step = strategy.train_step(model, loss_fn, opt)
    return lambda x: step(x, None)


def raw_run(blocks: int, width: int) -> Callable[[torch.Tensor], None]:
    """FSDP2 as its tutorial writes it: fully_shard each block, then the root, on a model built on meta."""
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = Wide(blocks, width)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    for block in model.blocks:
        block.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor) -> None:
        loss_fn(model(x), None).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(kind: str, blocks: int, width: int, steps: int) -> dict[str, float]:
    """This process's peak added resident memory (MiB) and the job's samples/s."""
    gc.collect()  # the previous run's model (DDP's reference cycles) is freed now, not during this one
    baseline = _resident_mb()
    _reset_peak()
    step = raw_run(blocks, width) if kind == "raw fully_shard" else loom_run(kind, blocks, width)
    x = torch.randn(PER_REPLICA_BATCH, width)
    for _ in range(2):
        step(x)  # warm-up: optimizer state created, buffers allocated
    dist.barrier()
    seconds, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step(x)
        cpu.append(time.process_time() - start_cpu)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    peak = torch.tensor([_peak_mb() - baseline])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    cpu_ms = torch.tensor([statistics.median(cpu) * 1000])
    dist.all_reduce(cpu_ms, op=dist.ReduceOp.AVG)
    return {
        "peak_mb": peak.item(),
        "samples_per_sec": PER_REPLICA_BATCH * dist.get_world_size() / statistics.median(seconds),
        "cpu_ms_per_step": cpu_ms.item(),  # one process's, averaged over the processes
    }


def worker(out: str, steps: int) -> None:
    loom.ShardedStrategy()  # joins the job's process group once; the strategies below share it
    warm = raw_run(2, 64)  # library code paged in now is not any model's memory
    warm(torch.randn(2, 64))
    del warm
    results = {}
    for name, (blocks, width) in MODELS.items():
        for kind in KINDS:
            results[f"{name}/{kind}"] = measure(kind, blocks, width, steps)
    results["collectives_ms"] = collectives(MODELS["fits"])
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def collectives(model: tuple[int, int]) -> dict[str, float]:
    """Milliseconds of each collective on the fits model's parameters: what one step of each strategy moves."""
    from loom.strategies.model_parallel.fsdp_comms import AllToAllReduceScatter

    reduce_scatter = AllToAllReduceScatter()
    blocks, width = model
    full = torch.zeros(blocks * (width * width + width))
    shard = torch.zeros(full.numel() // dist.get_world_size())
    ops = {
        "all_reduce (Mirrored, once a step)": lambda: dist.all_reduce(full),
        "all_gather (Sharded, twice a step)": lambda: dist.all_gather_single(full[: shard.numel() * dist.get_world_size()], shard),
        "reduce_scatter (gloo's, raw fully_shard)": lambda: dist.reduce_scatter_single(shard, full[: shard.numel() * dist.get_world_size()]),
        "reduce_scatter by all_to_all (Sharded, once a step)": lambda: reduce_scatter(shard, full[: shard.numel() * dist.get_world_size()], dist.group.WORLD, dist.ReduceOp.AVG),
    }
    found = {}
    for name, op in ops.items():
        op()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            op()
        dist.barrier()
        found[name] = (time.perf_counter() - start) / 5 * 1000
    return found


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-mb", type=float, default=256.0, help="simulated memory a process may hold")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        return worker(args.worker_out, args.steps)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    results: dict[str, Any] = {"machine": machine(), "budget_mb": args.budget_mb, "models": {}, "runs": {}}
    for name, (blocks, width) in MODELS.items():
        params = blocks * (width * width + width)
        results["models"][name] = {"parameters": params, "state_mb_unsharded": params * 16 / 2**20}
    for n in args.replicas:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            if run_job([__file__, "--worker-out", out.name, "--steps", str(args.steps)], LaunchOptions(nproc=n, threads=1)):
                raise SystemExit(f"the run on {n} processes failed")
            runs = json.loads(Path(out.name).read_text())
        collective_ms = runs.pop("collectives_ms")
        print(f"{n} processes, collectives on the fits model's parameters: " + ", ".join(f"{k} {v:.0f} ms" for k, v in collective_ms.items()))
        for key, found in runs.items():
            found["fits_budget"] = found["peak_mb"] <= args.budget_mb
            print(f"{n} processes, {key}: {found['samples_per_sec']:,.0f} samples/s, {found['cpu_ms_per_step']:.0f} ms CPU a step,"
                  f" peak {found['peak_mb']:.0f} MiB per process"
                  f" ({'within' if found['fits_budget'] else 'OVER'} the {args.budget_mb:.0f} MiB budget)", flush=True)  # fmt: skip
        results["runs"][str(n)] = runs
        results.setdefault("collectives_ms", {})[str(n)] = collective_ms
        speed = {kind: runs[f"fits/{kind}"]["samples_per_sec"] for kind in KINDS}
        cpu = {kind: runs[f"fits/{kind}"]["cpu_ms_per_step"] for kind in KINDS}
        for kind in ("sharded", "sharded, no reshard"):
            fits, raw = speed[kind] / speed["mirrored"], speed[kind] / speed["raw fully_shard"]
            results.setdefault(f"{kind}_over_mirrored_where_both_fit", {})[str(n)] = fits
            results.setdefault(f"{kind}_over_raw_fully_shard", {})[str(n)] = raw
            print(f"{n} processes: {kind} {fits:.2f}x Mirrored's throughput where both fit (target >= 0.9x), "
                  f"{cpu[kind] / cpu['mirrored']:.2f}x its CPU a step; {raw:.2f}x raw fully_shard")
    path = save("sharded", results)
    plot(results, RESULTS / "sharded.png")
    print(f"saved {path} and {RESULTS / 'sharded.png'}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{n} proc\n{model}" for n in results["runs"] for model in MODELS]
    width = 0.2
    for i, kind in enumerate(KINDS):
        peaks = [results["runs"][n][f"{m}/{kind}"]["peak_mb"] for n in results["runs"] for m in MODELS]
        speed = [results["runs"][n][f"{m}/{kind}"]["samples_per_sec"] for n in results["runs"] for m in MODELS]
        xs = [j + (i - 1.5) * width for j in range(len(labels))]
        axes[0].bar(xs, peaks, width, label=kind)
        axes[1].bar(xs, speed, width, label=kind)
    axes[0].axhline(results["budget_mb"], color="red", linestyle="--", label="per-process budget")
    axes[0].set_ylabel("peak memory per process (MiB)")
    axes[1].set_ylabel("samples/s (whole job)")
    for ax in axes:
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle("ShardedStrategy vs MirroredStrategy (CPU, gloo, 1 thread per process, machine under load)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
