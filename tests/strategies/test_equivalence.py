"""N synchronous replicas on global batch B must equal one replica on batch B."""

import pytest
import torch

import loom
from tests.helpers import SCRIPTS, loom_run, start_nodes, wait_all

TOLERANCE = 1e-5
SCRIPT = str(SCRIPTS / "train_mlp.py")


def reference(batch_size=32, accumulate=1):
    from tests.scripts.train_mlp import train

    return train(loom.OneDeviceStrategy(), batch_size=batch_size, accumulate=accumulate).state_dict()


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


@pytest.mark.parametrize("nproc", [2, 4])
def test_mirrored_equals_one_device(tmp_path, nproc):
    assert max_difference(run_mirrored(tmp_path, nproc), reference()) <= TOLERANCE


def test_multi_worker_mirrored_two_nodes_equals_one_device(tmp_path):
    out = tmp_path / "mwm.pt"
    nodes = start_nodes(2, 2, [SCRIPT, "--strategy", "multi_worker_mirrored", "--out", str(out)])
    for code, _, err in wait_all(nodes):
        assert code == 0, err
    assert max_difference(torch.load(out, weights_only=True), reference()) <= TOLERANCE


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    # 2 replicas x 2 micro-batches of 16 == one replica on batch 32
    assert max_difference(run_mirrored(tmp_path, 2, "--accumulate", "2"), reference()) <= TOLERANCE
    assert max_difference(reference(accumulate=4), reference()) <= TOLERANCE


def test_mirrored_on_one_machine_refuses_two_nodes(tmp_path):
    nodes = start_nodes(2, 1, [SCRIPT, "--strategy", "mirrored", "--out", str(tmp_path / "x.pt")], timeout=30)
    results = wait_all(nodes, timeout=90)
    assert all(code != 0 for code, _, _ in results)
    assert "MirroredStrategy is for one machine but this job spans 2 nodes; use MultiWorkerMirroredStrategy" in results[0][2]
