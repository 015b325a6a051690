"""Train a few Adam steps and save, or restore and compare, under whatever strategy the launch implies.

    checkpoint_job.py save DIR REFERENCE      train 5 steps, save at step 5, write the reference state
    checkpoint_job.py restore DIR REFERENCE   restore into fresh objects, compare with the reference
"""

import sys

import torch
from torch import nn

import loom


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))


def optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """Per-parameter Adam state in parameter order, comparable across processes."""
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    return {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(inner.state.values())}


def main() -> None:
    mode, directory, reference = sys.argv[1:4]
    strategy = loom.auto_strategy()
    torch.manual_seed(0)
    prepared, opt = strategy.prepare(model(), lambda p: torch.optim.Adam(p, lr=0.01))
    if mode == "save":
        g = torch.Generator().manual_seed(strategy.replica_id)
        for _ in range(5):
            x = torch.randn(16, 6, generator=g)
            strategy.backward(prepared(x).square().mean())
            opt.step()
            opt.zero_grad()
        strategy.save(directory, step=5, model=prepared, optimizer=opt, epoch=2)
        if strategy.is_chief:
            torch.save({"model": loom.unwrap(prepared).state_dict(), "optim": optimizer_state(opt)}, reference)
    else:
        torch.manual_seed(123)  # different initial weights: the restore must overwrite them
        saved = strategy.restore(directory, model=prepared, optimizer=opt)
        expected = torch.load(reference)
        got = {"model": loom.unwrap(prepared).state_dict(), "optim": optimizer_state(opt)}
        assert saved["step"] == 5 and saved["epoch"] == 2 and saved["world_size"] == 4, saved
        for key, value in expected["model"].items():
            assert torch.equal(value, got["model"][key]), key
        assert expected["optim"].keys() == got["optim"].keys()
        for i, state in expected["optim"].items():
            for key, value in state.items():
                assert torch.equal(value, got["optim"][i][key]), (i, key)
        print(f"{type(strategy).__name__} replica {strategy.replica_id} of {strategy.num_replicas_in_sync}: restored identical state", flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
