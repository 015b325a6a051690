"""Two replicas save two checkpoints; bytes of the newest are flipped; both replicas must refuse it
in the same line, and with ``fallback`` both restore the one before it.

    damaged_job.py DIR
"""

import sys
from pathlib import Path

import torch
from torch import nn

import loom
from loom.errors import CheckpointError
from tests.checkpoint import tamper


def main() -> None:
    directory = Path(sys.argv[1])
    strategy = loom.MirroredStrategy()
    torch.manual_seed(0)
    model, opt = strategy.prepare(nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3)), lambda p: torch.optim.Adam(p, lr=0.01))

    def step() -> None:
        strategy.backward(model(torch.randn(8, 6)).square().mean())
        opt.step()
        opt.zero_grad()

    step()
    strategy.save(directory, step=1, model=model, optimizer=opt)
    first = [p.detach().clone() for p in model.parameters()]
    step()
    newest = strategy.save(directory, step=2, model=model, optimizer=opt)
    if strategy.is_chief:
        tamper.flip(max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size))
    strategy.barrier()
    try:
        strategy.restore(directory, model=model, optimizer=opt)
        print(f"replica {strategy.replica_id}: restored a damaged checkpoint", flush=True)
    except CheckpointError as error:
        print(f"replica {strategy.replica_id}: refused: {error}", flush=True)
    saved = strategy.restore(directory, model=model, optimizer=opt, fallback=True)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), first))
    print(f"replica {strategy.replica_id}: fell back to step {saved['step']}, weights {'equal' if same else 'differ'}", flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
