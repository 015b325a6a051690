"""Restore a click model saved by a parameter-server job, under whatever strategy the launch implies.

    restore_clicks.py CKPT_DIR REFERENCE
"""

import sys

import torch
from torch import nn

import loom


class Clicks(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, 8, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids):
        return self.mlp(self.bag(ids)).squeeze(1)


def main() -> None:
    directory, reference = sys.argv[1:3]
    strategy = loom.auto_strategy()
    torch.manual_seed(123)
    model, _ = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.1))
    saved = strategy.restore(directory, model=model)
    expected = torch.load(reference)
    got = loom.unwrap(model).state_dict()
    assert saved["step"] == 5 and saved["strategy"] == "ParameterServerStrategy", saved
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    print(f"{type(strategy).__name__} replica {strategy.replica_id}: restored the parameter servers' state", flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
