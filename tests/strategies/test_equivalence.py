"""N synchronous replicas on global batch B must equal one replica on batch B.

The contract (tests/contract/) runs this on two replicas, two nodes and with accumulation;
here, four replicas on one machine, and the refusal of two nodes under MirroredStrategy.
"""

import torch

import loom
from tests.helpers import SCRIPTS, loom_run, start_nodes, wait_all

TOLERANCE = 1e-5
SCRIPT = str(SCRIPTS / "train_mlp.py")


def reference():
    from tests.scripts.train_mlp import train

    return train(loom.OneDeviceStrategy(), batch_size=32).state_dict()


def max_difference(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run_mirrored(tmp_path, nproc, *script_args, strategy="mirrored"):
    out = tmp_path / f"{strategy}-{nproc}.pt"
    done = loom_run(["run", "--nproc", str(nproc), "--timeout", "60", SCRIPT, "--strategy", strategy, "--out", str(out), *script_args])
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True)


def test_reference_training_moves_the_parameters():
    from tests.scripts.train_mlp import mlp

    assert max_difference(reference(), mlp().state_dict()) > 0.05  # equality below is not "nothing moved"


def test_mirrored_on_four_replicas_equals_one_device(tmp_path):
    assert max_difference(run_mirrored(tmp_path, 4), reference()) <= TOLERANCE


def test_mirrored_on_one_machine_refuses_two_nodes(tmp_path):
    nodes = start_nodes(2, 1, [SCRIPT, "--strategy", "mirrored", "--out", str(tmp_path / "x.pt")], timeout=30)
    results = wait_all(nodes, timeout=90)
    assert all(code != 0 for code, _, _ in results)
    assert "MirroredStrategy is for one machine but this job spans 2 nodes; use MultiWorkerMirroredStrategy" in results[0][2]
