"""What a local SGD checkpoint saved mid-period restores: each replica's own state on as many replicas,
the replicas' mean on another number (with a warning), nothing at all from an empty directory."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from tests.helpers import run_ranks
from tests.scripts.fit_job import data

pytestmark = pytest.mark.xdist_group("local_sgd_resume")  # its tests share one saving job: one test process runs them


def _prepared(strategy: loom.Strategy):
    torch.manual_seed(0)
    return strategy.prepare(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)), lambda p: torch.optim.Adam(p, lr=0.05))


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"param.{n}": p.detach().clone() for n, p in loom.unwrap(model).named_parameters()}
    state.update({f"optim.{i}.{k}": v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()})
    return state


def _save_mid_period(directory: str) -> dict:
    """Two Adam steps apart (a sync every 3), an empty restore, a save; the third step, which syncs; then a
    fresh model restored from the save."""
    strategy = loom.LocalSGDStrategy(sync_every=3)
    model, opt = _prepared(strategy)
    step = strategy.train_step(model, F.cross_entropy, opt)
    batches = list(strategy.distribute(data(48, 0), batch_size=16, shuffle=False))
    for x, y in batches[:2]:
        step(x, y)
    before = _state(model, opt)
    nothing = strategy.restore(f"{directory}/empty", model=model, optimizer=opt)
    unchanged = all(torch.equal(v, _state(model, opt)[k]) for k, v in before.items())
    strategy.save(f"{directory}/ckpt", model=model, optimizer=opt)
    saved = _state(model, opt)
    step(*batches[2])
    synced = strategy.gather(next(model.parameters()).detach().reshape(1, -1))
    restored = _restore(directory, strategy)
    return {"nothing": nothing, "unchanged": unchanged, "saved": saved, "in_sync_after_step_3": torch.equal(synced[0], synced[-1]),
            "restored": restored}  # fmt: skip


def _restore(directory: str, strategy: loom.Strategy | None = None) -> dict:
    strategy = strategy or loom.LocalSGDStrategy(sync_every=3)
    model, opt = _prepared(strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.restore(f"{directory}/ckpt", model=model, optimizer=opt)
    strategy.shutdown()
    return {"state": _state(model, opt), "warnings": [str(w.message) for w in caught]}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Both replicas' results of ``_save_mid_period``, and the directory of its checkpoint."""
    directory = tmp_path_factory.mktemp("local_sgd")
    return run_ranks(_save_mid_period, 2, str(directory), timeout=90), directory


def test_each_replica_restores_its_own_state_and_an_empty_directory_changes_nothing(checkpoint):
    saved, directory = checkpoint
    for rank in saved:
        assert rank["nothing"] is None and rank["unchanged"], "restoring an empty directory changed the state"
        assert rank["in_sync_after_step_3"], "the restore of an empty directory restarted the period: no sync after step 3"
    assert not _same(saved[0]["saved"], saved[1]["saved"]), "the replicas should be apart mid-period"
    for rank in range(2):
        restored = saved[rank]["restored"]
        assert _same(restored["state"], saved[rank]["saved"]), f"replica {rank} did not get its own state back"
        assert not restored["warnings"]


def test_on_another_number_of_replicas_every_replica_starts_from_the_mean_and_replica_0s_optimizer(checkpoint):
    saved, directory = [rank["saved"] for rank in checkpoint[0]], checkpoint[1]
    [alone] = run_ranks(_restore, 1, str(directory), timeout=90)
    for key, value in alone["state"].items():
        expected = saved[0][key] / 2 + saved[1][key] / 2 if key.startswith("param.") else saved[0][key]
        assert torch.equal(value, expected), key
    assert alone["warnings"] == [
        f"loom: {directory}/ckpt/step-00000000 holds 2 replicas of 'model' and this job has 1: every replica starts "
        "from their mean with replica 0's optimizer state, as after a sync"
    ]
