"""Restore a click model saved by a parameter-server job, under whatever strategy the launch implies.

    restore_clicks.py CKPT_DIR REFERENCE
"""

import sys

import torch

import loom
from tests.scripts.clicks import Clicks


def main() -> None:
    directory, reference = sys.argv[1:3]
    strategy = loom.auto_strategy()
    model, _ = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.1))  # untrained: restore overwrites it
    saved = strategy.restore(directory, model=model)
    expected = torch.load(reference)
    got = loom.unwrap(model).state_dict()
    assert saved["step"] == 5 and saved["strategy"] == "ParameterServerStrategy", saved
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    print(f"{type(strategy).__name__} replica {strategy.replica_id}: restored the parameter servers' state", flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
