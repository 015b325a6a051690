"""A parameter-server worker whose optimizer the servers refuse (NAdam): the chief fails in prepare,
the other workers wait for variables the chief never creates."""

import torch
from torch import nn

import loom

strategy = loom.ParameterServerStrategy()
with strategy.scope():
    model = nn.Linear(4, 1)
model, opt = strategy.prepare(model, lambda params: torch.optim.NAdam(params, lr=0.01))
raise SystemExit("unreachable: the chief's NAdam is refused and the other workers time out")
