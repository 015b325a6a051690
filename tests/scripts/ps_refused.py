"""A parameter-server worker whose optimizer the servers refuse (RMSprop): the chief fails in prepare,
the other workers wait for variables the chief never creates."""

import torch
from torch import nn

import loom

strategy = loom.ParameterServerStrategy()
with strategy.scope():
    model = nn.Linear(4, 1)
model, opt = strategy.prepare(model, lambda params: torch.optim.RMSprop(params, lr=0.01))
raise SystemExit("unreachable: the chief's RMSprop is refused and the other workers time out")
