"""distribute(DataLoader): its sampler, shuffle and drop_last honoured; per-batch random seeds; resume checks."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from loom.data import DistributedLoader

CPU = torch.device("cpu")


def indexed(n):
    return TensorDataset(torch.arange(n))


def epoch(loader):
    return [b[0].tolist() for b in loader]


def global_batches(source, replicas, **kw):
    loaders = [DistributedLoader(source, None, replicas, r, CPU, **kw) for r in range(replicas)]
    per = [epoch(loader) for loader in loaders]
    return [sum(parts, []) for parts in zip(*per)]


def test_weighted_sampler_is_sharded_not_replaced():
    weights = torch.tensor([0.0, 1.0] * 20)  # only odd samples may be drawn
    source = DataLoader(indexed(40), batch_size=8, sampler=WeightedRandomSampler(weights, 24, generator=torch.Generator().manual_seed(7)))
    one = global_batches(source, 1)
    assert len(one) == 3 and all(i % 2 for b in one for i in b)
    assert global_batches(source, 2) == global_batches(source, 4) == one  # every replica drew the same order
    loader = DistributedLoader(source, None, 2, 0, CPU)
    first, second = epoch(loader), epoch(loader)
    assert first != second  # a new draw each epoch
    loader.set_epoch(0)
    assert epoch(loader) == first


def test_subset_sampler_keeps_its_subset():
    source = DataLoader(indexed(30), batch_size=4, sampler=SubsetRandomSampler(range(10, 20)))
    assert sorted(sum(global_batches(source, 2), [])) == list(range(10, 20))


def test_dataloader_order_and_drop_last_are_honoured():
    assert global_batches(DataLoader(indexed(12), batch_size=4), 2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    shuffled = global_batches(DataLoader(indexed(12), batch_size=4, shuffle=True), 2)
    assert sorted(sum(shuffled, [])) == list(range(12)) and sum(shuffled, []) != list(range(12))
    assert global_batches(DataLoader(indexed(10), batch_size=4, drop_last=True), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    explicit = DataLoader(indexed(10), batch_sampler=BatchSampler(SequentialSampler(range(10)), 4, drop_last=True))
    assert global_batches(explicit, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_dataloader_over_a_stream_keeps_its_order_unless_asked_to_shuffle():
    from tests.data.test_sharding import Stream

    def stream(**kw):
        per = [[b.tolist() for b in DistributedLoader(DataLoader(Stream(12), batch_size=4), None, 2, r, CPU, **kw)] for r in range(2)]
        return [i for parts in zip(*per) for part in parts for i in part]

    assert stream() == list(range(12))
    shuffled = stream(shuffle=True)
    assert sorted(shuffled) == list(range(12)) and shuffled != list(range(12))


def test_conflicting_or_unsplittable_dataloaders_are_refused():
    with pytest.raises(ValueError, match=r"distribute\(shuffle=True\) conflicts with the DataLoader's SequentialSampler \(no shuffle\)"):
        DistributedLoader(DataLoader(indexed(8), batch_size=4), None, 2, 0, CPU, shuffle=True)
    with pytest.raises(ValueError, match=r"distribute\(drop_last=False\) conflicts with the DataLoader's drop_last=True"):
        DistributedLoader(DataLoader(indexed(8), batch_size=4, drop_last=True), None, 2, 0, CPU, drop_last=False)
    custom = DataLoader(indexed(8), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"batch_sampler \(list\) makes batches loom cannot split over replicas"):
        DistributedLoader(custom, None, 2, 0, CPU)


def test_a_ddp_dataloader_says_what_to_pass_instead():
    ddp = DataLoader(indexed(32), batch_size=8, sampler=DistributedSampler(indexed(32), num_replicas=2, rank=0))
    with pytest.raises(ValueError, match=r"DistributedSampler \(DDP's: batch_size=8 per replica\).* pass DataLoader\(dataset, batch_size=16, shuffle=True\)"):
        DistributedLoader(ddp, None, 2, 0, CPU)


class Noisy(Dataset):
    """Each sample: its index and a draw from torch's, NumPy's and Python's generators."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), np.random.rand(), random.random(), TAG])


TAG = 0.0


def tag_worker(worker_id):
    global TAG
    TAG = 1.0


def draws(replica, workers, start=0, epoch_=0, init=None):
    source = DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=workers, worker_init_fn=init)
    loader = DistributedLoader(source, None, 2, replica, CPU)
    if start:
        loader.load_state_dict({"epoch": epoch_, "batch": start, "global_batch": 4, "samples": 16})
    else:
        loader.set_epoch(epoch_)
    return torch.cat(list(loader))


def test_workers_draw_per_replica_and_epoch_reproducibly_and_after_resume():
    r0, r1 = draws(0, 2, init=tag_worker), draws(1, 2)
    assert set(r0[:, 4].tolist()) == {1.0}  # the user's worker_init_fn ran
    for column in (1, 2, 3):  # torch, numpy, random
        assert len(set(r0[:, column].tolist() + r1[:, column].tolist())) == 16, "replicas drew the same numbers"
    assert torch.equal(draws(0, 0)[:, :4], r0[:, :4])  # the same whatever the number of workers
    assert not torch.equal(draws(0, 2, epoch_=1)[:, 1:4], r0[:, 1:4])
    uninterrupted = draws(1, 2, epoch_=1)
    assert torch.equal(draws(1, 2, start=2, epoch_=1), uninterrupted[4:])  # batches 2 and 3 of epoch 1


def test_reading_in_the_training_process_leaves_its_random_state_alone():
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    list(DistributedLoader(Noisy(), 4, 1, 0, CPU))
    assert torch.equal(torch.rand(2), expected)


def test_a_position_from_another_global_batch_or_data_set_is_refused():
    saved = DistributedLoader(indexed(96), 48, 2, 0, CPU)
    it = iter(saved)
    next(it)
    with pytest.raises(ValueError, match="counts global batches of 48; this run uses 24: resume with the same global batch size"):
        DistributedLoader(indexed(96), 24, 2, 0, CPU).load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="is for 96 samples an epoch; this data has 90: it is not the same data"):
        DistributedLoader(indexed(90), 48, 2, 0, CPU).load_state_dict(saved.state_dict())
    other_world = DistributedLoader(indexed(96), 48, 3, 0, CPU)  # sharded by sample: any replica count resumes
    other_world.load_state_dict(saved.state_dict())
    assert len(epoch(other_world)) == 1


def real_samples(loader):
    """What a training loop counts: the first valid_count(k) samples of each batch of this iteration."""
    return [i for k, b in enumerate(loader) for i in b[0][: loader.valid_count(k)].tolist()]


@pytest.mark.parametrize("sampler", [False, True])
def test_valid_counts_of_a_resumed_shuffled_epoch_count_each_sample_once(sampler):
    weights = torch.ones(23)
    kw = {"sampler": WeightedRandomSampler(weights, 23, replacement=False)} if sampler else {"shuffle": True}
    source = DataLoader(indexed(23), batch_size=8, **kw)  # 3 batches, the last of 7 padded to slices of 4
    counted = []
    for r in range(2):
        first = DistributedLoader(source, None, 2, r, CPU)
        first.set_epoch(1)
        it = iter(first)
        counted += next(it)[0].tolist()
        resumed = DistributedLoader(source, None, 2, r, CPU)
        resumed.load_state_dict(first.state_dict())
        counted += real_samples(resumed)
    assert sorted(counted) == list(range(23))


def test_a_batch_size_that_contradicts_the_dataloader_is_refused():
    import loom

    loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=8)
    with pytest.raises(ValueError, match=r"distribute\(batch_size=4\) conflicts with the DataLoader's batch_size=8 \(the global batch\)"):
        loom.OneDeviceStrategy().distribute(loader, batch_size=4)
    assert loom.OneDeviceStrategy().distribute(loader, batch_size=8).global_batch == 8
