"""stream_batches: row i continues from batch to batch on the same replica; N replicas carrying state equal 1."""

import runpy

import pytest
import torch

from loom.data import DistributedLoader, stream_batches
from tests.helpers import ROOT, run_ranks

CPU = torch.device("cpu")
EXAMPLE = str(ROOT / "examples" / "stream_language_model.py")


def test_rows_continue_and_each_replica_always_owns_the_same_rows():
    streams = stream_batches(torch.arange(101), batch_size=4, seq_len=5)  # rows of 25 tokens, 5 steps
    assert len(streams) == 20
    replicas = [list(DistributedLoader(streams, None, 2, r, CPU)) for r in range(2)]
    assert [len(batches) for batches in replicas] == [5, 5]
    for r, batches in enumerate(replicas):
        for k, (x, y) in enumerate(batches):
            rows = [2 * r, 2 * r + 1]  # replica r's rows, at every step
            assert x.tolist() == [list(range(i * 25 + k * 5, i * 25 + k * 5 + 5)) for i in rows]
            assert torch.equal(y, x + 1)
            if k:
                assert torch.equal(x[:, 0], batches[k - 1][0][:, -1] + 1)  # continues the previous batch's rows


def test_stream_layout_is_kept_or_refused():
    streams = stream_batches(list(range(50)), batch_size=4, seq_len=3)
    with pytest.raises(ValueError, match="stream_batches data cannot be shuffled: row i of each batch continues row i"):
        DistributedLoader(streams, None, 2, 0, CPU, shuffle=True)
    with pytest.raises(ValueError, match=r"distribute\(batch_size=8\) differs from the stream_batches layout's 4 rows"):
        DistributedLoader(streams, 8, 2, 0, CPU)
    with pytest.raises(ValueError, match=r"20 tokens give 4 rows of 4, shorter than seq_len=5; it needs at least .* = 21 tokens"):
        stream_batches(torch.arange(20), 4, 5)


def _train(steps, replicated):
    import loom

    strategy = loom.MirroredStrategy(timeout=30) if replicated else loom.OneDeviceStrategy()
    weights, losses = runpy.run_path(EXAMPLE)["train"](strategy, steps=steps)
    replicas = strategy.num_replicas_in_sync
    strategy.shutdown()
    return weights, losses, replicas


def test_two_replicas_carrying_hidden_state_equal_one_on_the_global_batch():
    one, losses, _ = _train(12, False)
    assert losses[-1] < losses[0] - 0.3  # it learns: equality below is not "nothing moved"
    for weights, replica_losses, replicas in run_ranks(_train, 2, 12, True, timeout=90):
        assert replicas == 2
        assert max((weights[k] - one[k]).abs().max().item() for k in one) < 1e-5
        assert replica_losses == pytest.approx(losses, abs=1e-5)
