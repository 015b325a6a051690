"""One peer's run of a workload on 2 CPU processes: loom, hand-written DDP, Accelerate, Lightning Fabric.

    torchrun --nproc-per-node 2 bench/peers/torch_peers.py PEER WORKLOAD STEPS OUT   (ddp, accelerate, fabric)
    loom run --nproc 2 bench/peers/torch_peers.py loom WORKLOAD STEPS OUT

Each does what its documentation shows for data-parallel training on CPU: the same model from
bench/workloads.py, SGD with momentum, cross-entropy, the same global batch split over the
processes, one intra-op thread per process. Rank 0 writes samples/s over STEPS timed steps
(after 3 warm-up steps) to OUT. Accelerate and Fabric run in .venv-peers, which has no loom.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.workloads import WORKLOADS, Workload  # noqa: E402

WARMUP = 3


def batches(workload: Workload, rank: int, world: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """This process's share of ever new global batches (random values: speed does not depend on them)."""
    data = workload.data(4)
    local = workload.global_batch // world
    state = {"i": 0}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        start = (state["i"] % 4) * workload.global_batch + rank * local
        state["i"] += 1
        x, y = data[start : start + local]
        return x, y

    return next_batch


def run(peer: str, workload: Workload, steps: int) -> float:
    """Samples/s of ``steps`` steps of ``peer`` (after warm-up), timed between two barriers."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if peer == "loom":
        import loom
        from bench.workloads import loom_step

        strategy = loom.MirroredStrategy()
        step = loom_step(strategy, workload, workload.data(4))
    else:
        dist.init_process_group("gloo") if peer == "ddp" else None
        step = _peer_step(peer, workload)
    for _ in range(WARMUP):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return steps * workload.global_batch / (time.perf_counter() - start)


def _peer_step(peer: str, workload: Workload) -> Callable[[], None]:
    model = workload.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if peer == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()  # noqa: E731
    elif peer == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        backward = accelerator.backward
    elif peer == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        model, opt = fabric.setup(model, opt)
        backward = fabric.backward
    else:
        raise ValueError(f"unknown peer {peer!r}: loom, ddp, accelerate or fabric")
    next_batch = batches(workload, dist.get_rank(), dist.get_world_size())

    def step() -> None:
        x, y = next_batch()
        backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    peer, name, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    rate = run(peer, WORKLOADS[name], steps)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"peer": peer, "workload": name, "samples_per_sec": rate, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
