import pytest
import torch

from loom import comm
from tests.helpers import run_ranks


def _all_collectives():
    import loom

    strategy = loom.MirroredStrategy(timeout=30)
    r, n = comm.rank(), comm.world_size()
    out = {}
    out["all_reduce_sum"] = comm.all_reduce(torch.tensor([float(r + 1)])).item()
    out["all_reduce_mean"] = comm.all_reduce(torch.tensor([float(r + 1)]), "mean").item()
    out["all_reduce_max"] = comm.all_reduce(torch.tensor([float(r)]), "max").item()
    reduced = comm.reduce(torch.tensor([float(r + 1)]), dst=1, op="mean")
    out["reduce_on_dst"] = reduced.item() if r == 1 else None
    out["broadcast"] = comm.broadcast(torch.tensor([float(r * 10)]), src=2).item()
    out["all_gather_uneven"] = comm.all_gather(torch.full((r + 1,), float(r))).tolist()
    gathered = comm.gather(torch.tensor([float(r)]), dst=0)
    out["gather"] = [t.item() for t in gathered] if r == 0 else gathered
    chunks = [torch.tensor([float(i * i)]) for i in range(n)] if r == 3 else None
    out["scatter"] = comm.scatter(torch.zeros(1), chunks, src=3).item()
    out["reduce_scatter"] = comm.reduce_scatter(torch.arange(2.0 * n) + r).tolist()
    comm.barrier()
    out["strategy_reduce_int"] = strategy.reduce(r, "sum")
    out["strategy_reduce_mean"] = strategy.reduce(float(r), "mean")
    out["strategy_reduce_min_tensor"] = strategy.reduce(torch.tensor([r + 5]), "min").tolist()
    out["strategy_gather_scalar"] = strategy.gather(torch.tensor(float(r))).tolist()
    strategy.shutdown()
    return out


def test_collectives_on_four_ranks():
    results = run_ranks(_all_collectives, 4, timeout=90)
    for r, out in enumerate(results):
        assert out["all_reduce_sum"] == 10
        assert out["all_reduce_mean"] == 2.5
        assert out["all_reduce_max"] == 3
        assert out["broadcast"] == 20
        assert out["all_gather_uneven"] == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
        assert out["scatter"] == r * r
        # sum over ranks of (arange(8) + rank) = 4*arange(8) + 6; rank r keeps elements 2r, 2r+1
        assert out["reduce_scatter"] == [4 * (2 * r) + 6, 4 * (2 * r + 1) + 6]
        assert out["strategy_reduce_int"] == 6 and isinstance(out["strategy_reduce_int"], int)
        assert out["strategy_reduce_mean"] == 1.5
        assert out["strategy_reduce_min_tensor"] == [5]
        assert out["strategy_gather_scalar"] == [0, 1, 2, 3]
    assert results[1]["reduce_on_dst"] == 2.5
    assert results[0]["gather"] == [0, 1, 2, 3] and results[1]["gather"] is None


def test_collectives_without_a_process_group_are_one_replica():
    t = torch.tensor([3.0, 4.0])
    assert comm.all_reduce(t.clone(), "mean").tolist() == [3.0, 4.0]
    assert comm.all_gather(t).tolist() == [3.0, 4.0]
    assert comm.reduce_scatter(t).tolist() == [3.0, 4.0]
    with pytest.raises(ValueError, match="unknown reduce op 'avg'; use one of sum, mean, max, min, product"):
        comm.all_reduce(t, "avg")
