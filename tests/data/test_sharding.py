import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from loom.data import DistributedLoader, ShardPlan

CPU = torch.device("cpu")


def indexed(n):
    return TensorDataset(torch.arange(n))


def replica_batches(data, replicas, **kw):
    """Per replica, the list of batches (as lists of sample ids) of one epoch."""
    loaders = [DistributedLoader(data, num_replicas=replicas, replica=r, device=CPU, **kw) for r in range(replicas)]
    return loaders, [[b[0].tolist() for b in loader] for loader in loaders]


def global_batches(per_replica):
    return [sum((batches[k] for batches in per_replica), []) for k in range(len(per_replica[0]))]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_one_epoch_covers_every_sample_exactly_once(replicas, shuffle):
    n = 24 * 10
    _, batches = replica_batches(indexed(n), replicas, batch_size=24, shuffle=shuffle, seed=3)
    seen = [i for per in batches for b in per for i in b]
    assert sorted(seen) == list(range(n))
    assert len({len(per) for per in batches}) == 1  # every replica runs the same number of steps


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_batches_do_not_depend_on_replica_count(shuffle):
    reference = global_batches(replica_batches(indexed(96), 1, batch_size=12, shuffle=shuffle, seed=5)[1])
    for replicas in (2, 3, 4):
        batches = global_batches(replica_batches(indexed(96), replicas, batch_size=12, shuffle=shuffle, seed=5)[1])
        assert batches == reference
    if not shuffle:
        assert reference[2] == list(range(24, 36))


def test_new_iteration_is_a_new_epoch_and_set_epoch_replays_one():
    loader = DistributedLoader(indexed(64), batch_size=8, num_replicas=2, replica=0, device=CPU, seed=1)
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    assert first != second
    loader.set_epoch(0)
    assert [b[0].tolist() for b in loader] == first


def test_uneven_last_batch_pads_and_reports_real_samples():
    # 10 samples in global batches of 6 over 3 replicas: the last batch has 4 real samples, slices of 2.
    loaders, batches = replica_batches(indexed(10), 3, batch_size=6, shuffle=False)
    assert [len(per) for per in batches] == [2, 2, 2]
    assert [per[1] for per in batches] == [[6, 7], [8, 9], [6, 7]]  # replica 2 repeats the batch's first samples
    assert [loader.valid_count(1) for loader in loaders] == [2, 2, 0]
    real = [i for loader, per in zip(loaders, batches) for k, b in enumerate(per) for i in b[: loader.valid_count(k)]]
    assert sorted(real) == list(range(10))


def test_more_replicas_than_samples_in_last_batch_never_starves_a_replica():
    loaders, batches = replica_batches(indexed(9), 4, batch_size=8, shuffle=False)
    assert [len(per[1]) for per in batches] == [1, 1, 1, 1]
    assert [loader.valid_count(1) for loader in loaders] == [1, 0, 0, 0]


def test_drop_last():
    _, batches = replica_batches(indexed(10), 2, batch_size=4, shuffle=False, drop_last=True)
    assert global_batches(batches) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match=r"global batch_size 10 is not divisible by the 4 replicas in sync; use a multiple of 4 \(e.g. 8 or 12\)"):
        DistributedLoader(indexed(20), batch_size=10, num_replicas=4, replica=0, device=CPU)
    with pytest.raises(ValueError, match="positive integer"):
        ShardPlan(10, 0, 1)


def test_dataloader_batch_size_is_the_global_batch():
    source = DataLoader(indexed(32), batch_size=8)
    loaders, batches = replica_batches(source, 2, batch_size=None, shuffle=False)
    assert batches[1][0] == [4, 5, 6, 7]
    assert len(loaders[0]) == 4


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


@pytest.mark.parametrize("shuffle", [False, True])
def test_iterable_dataset_has_the_same_global_batches(shuffle):
    reference = global_batches([[b.tolist() for b in DistributedLoader(Stream(50), 10, 1, 0, CPU, shuffle=shuffle)]])
    loaders = [DistributedLoader(Stream(50), 10, 2, r, CPU, shuffle=shuffle) for r in range(2)]
    assert global_batches([[b.tolist() for b in loader] for loader in loaders]) == reference
    assert sorted(i for b in reference for i in b) == list(range(50))


def test_iterable_uneven_tail_valid_counts():
    loaders = [DistributedLoader(Stream(13), 4, 2, r, CPU, shuffle=False) for r in range(2)]
    batches = [[b.tolist() for b in loader] for loader in loaders]
    assert [per[-1] for per in batches] == [[12], [12]]
    assert [loader.valid_count(3) for loader in loaders] == [1, 0]


def test_bad_data_type():
    with pytest.raises(TypeError, match="takes a torch Dataset, an iterable or a DataLoader"):
        DistributedLoader(42, 4, 1, 0, CPU)


def _replica_samples(n, global_batch):
    import loom

    strategy = loom.MirroredStrategy(timeout=30)
    loader = strategy.distribute(TensorDataset(torch.arange(n)), batch_size=global_batch, seed=4)
    real = [b[0][: loader.valid_count(k)] for k, b in enumerate(loader)]
    everyone = strategy.gather(torch.cat(real))
    strategy.shutdown()
    return len(loader), everyone.tolist()


def test_exactly_once_through_the_strategy_on_three_processes():
    from tests.helpers import run_ranks

    results = run_ranks(_replica_samples, 3, 100, 12, timeout=60)  # 100 % 12 != 0: a padded last batch
    assert {steps for steps, _ in results} == {9}
    for _, seen in results:
        assert sorted(seen) == list(range(100))
