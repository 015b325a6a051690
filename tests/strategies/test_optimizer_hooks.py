"""The optimizer ``prepare`` returns is a torch Optimizer: its step hooks fire around each update
(not around a step skipped inside an accumulation cycle), LR schedulers reach the user's optimizer,
and a state dict loaded into the user's optimizer is the one the returned optimizer sees."""

import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from tests.helpers import run_ranks
from tests.scripts.clicks import Clicks
from tests.strategies.parameter_server.test_strategy import servers  # noqa: F401 - a fixture


def _hooked(opt):
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", o is opt)))
    return seen


def test_one_device_hooks_fire_once_per_update_and_the_scheduler_sets_the_user_s_lr():
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(nn.Linear(2, 1), lambda p: torch.optim.Adam(p, lr=0.1))
    seen, scheduler = _hooked(opt), torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with strategy.accumulate(2):
        for _ in range(4):  # two updates
            strategy.backward(model(torch.ones(1, 2)).sum())
            opt.step()
            opt.zero_grad()
            if strategy.sync_gradients:
                scheduler.step()
    assert seen == [("pre", True), ("post", True)] * 2
    assert opt.optimizer.param_groups[0]["lr"] == 0.025 and opt.param_groups is opt.optimizer.param_groups
    saved = opt.state_dict()
    assert saved["state"][0]["step"] == 2
    opt.optimizer.load_state_dict(saved)  # as a restore does, into the user's optimizer: it binds new state
    assert opt.state is opt.optimizer.state and opt.param_groups is opt.optimizer.param_groups


def test_parameter_server_hooks_fire_around_each_push_and_the_scheduler_reaches_the_servers(servers):  # noqa: F811
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    model, opt = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.1))
    seen, scheduler = _hooked(opt), torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ids = torch.arange(12).reshape(4, 3)
    lrs = []
    for _ in range(2):
        F.binary_cross_entropy_with_logits(model(ids), torch.ones(4)).backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        scheduler.step()
    strategy.shutdown()
    assert seen == [("pre", True), ("post", True)] * 2
    assert lrs == [0.1, 0.05] and opt.optimizer.param_groups[0]["lr"] == 0.025


def _local_sgd_hooks():
    strategy = loom.LocalSGDStrategy(sync_every=2)
    model, opt = strategy.prepare(nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    seen, scheduler = _hooked(opt), torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        strategy.backward(model(torch.ones(1, 2)).sum())
        opt.step()
        opt.zero_grad()
        scheduler.step()
    strategy.shutdown()
    return seen, opt.optimizer.param_groups[0]["lr"]


def test_local_sgd_s_optimizer_runs_the_hooks_once_around_each_update():
    [(seen, lr)] = run_ranks(_local_sgd_hooks, 1, timeout=120)
    assert seen == [("pre", True), ("post", True)] * 2 and lr == 0.025
