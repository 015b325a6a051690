"""Local SGD's sync meets for the same models in every process, whatever each one's garbage collector has done."""

import weakref

import torch
import torch.nn.functional as F
from torch import nn

import loom
from tests.helpers import collected, run_ranks


def _sync_after_a_model_was_dropped():
    strategy = loom.LocalSGDStrategy(sync_every=4)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(strategy.replica_id)), torch.zeros(8, dtype=torch.long)
    dropped, opt = strategy.prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    strategy.backward(F.cross_entropy(dropped(x), y))
    opt.step()  # its replicas are apart: they meet at the next sync
    kept, gone = [dropped], weakref.ref(dropped)
    del dropped, opt
    if strategy.replica_id == 1:  # process 1 lets go of it, and its collector frees it; process 0 still holds it
        kept.clear()
        assert collected(gone), "the dropped model was not freed"
    model, opt = strategy.prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    strategy.backward(F.cross_entropy(model(x), y))
    opt.step()
    apart = [p.detach().clone() for p in loom.unwrap(model).parameters()]
    strategy.sync()
    synced = [p.detach().clone() for p in loom.unwrap(model).parameters()]
    strategy.shutdown()
    return apart, synced


def test_a_sync_meets_for_the_same_models_in_every_process_whatever_their_collectors_did():
    (apart_0, synced_0), (apart_1, synced_1) = run_ranks(_sync_after_a_model_was_dropped, 2, timeout=120)
    for a, b, s0, s1 in zip(apart_0, apart_1, synced_0, synced_1):
        assert not torch.equal(a, b)
        assert torch.allclose(s0, (a + b) / 2) and torch.equal(s0, s1)


def _sync_after_a_restore_mid_period(directory):
    strategy = loom.LocalSGDStrategy(sync_every=4)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(strategy.replica_id)), torch.zeros(8, dtype=torch.long)
    model, opt = strategy.prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    strategy.backward(F.cross_entropy(model(x), y))
    opt.step()  # one step into the period
    strategy.save(directory, step=1, model=model, optimizer=opt)
    own = [p.detach().clone() for p in loom.unwrap(model).parameters()]
    again = loom.LocalSGDStrategy(sync_every=4)
    model, opt = again.prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    again.restore(directory, model=model, optimizer=opt)  # each replica its own parameters, apart
    restored = [p.detach().clone() for p in loom.unwrap(model).parameters()]
    again.sync()
    synced = [p.detach().clone() for p in loom.unwrap(model).parameters()]
    again.shutdown()
    return own, restored, synced


def test_a_period_restored_from_a_checkpoint_meets_at_the_next_sync(tmp_path):
    (own_0, restored_0, synced_0), (own_1, restored_1, synced_1) = run_ranks(_sync_after_a_restore_mid_period, 2, str(tmp_path), timeout=120)
    for a, b, ra, rb, s0, s1 in zip(own_0, own_1, restored_0, restored_1, synced_0, synced_1):
        assert torch.equal(ra, a) and torch.equal(rb, b) and not torch.equal(a, b)
        assert torch.allclose(s0, (a + b) / 2) and torch.equal(s0, s1)


def _a_model_every_process_dropped_is_let_go():
    strategy = loom.LocalSGDStrategy(sync_every=4)
    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    dropped, opt = strategy.prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    strategy.backward(F.cross_entropy(dropped(x), y))
    opt.step()  # apart: held until it meets, or until every process has dropped it
    module, weight = weakref.ref(dropped), weakref.ref(dropped.weight)
    del dropped, opt
    assert collected(module), "the dropped model was not freed"
    strategy.prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))  # the next prepare lets it go
    freed = collected(weight, within=10)
    strategy.shutdown()
    return freed


def test_an_apart_model_every_process_dropped_is_let_go_at_the_next_prepare():
    assert run_ranks(_a_model_every_process_dropped_is_let_go, 2, timeout=120) == [True, True]
