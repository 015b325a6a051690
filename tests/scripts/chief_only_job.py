"""Two replicas train under ShardedStrategy; after step 2 the first evaluates alone, the usual
chief-only code. Its forward's all-gathers meet the other replica's training ones: the job hangs.
Rank 0 prints when it starts to evaluate."""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import loom


def evaluate(model):
    with torch.no_grad():
        return model(torch.randn(8, 16))  # EVAL_FORWARD


def main():
    strategy = loom.ShardedStrategy()
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=0.1))
    train = strategy.train_step(model, F.cross_entropy, opt)
    for step in range(6):
        train(torch.randn(8, 16), torch.randint(0, 4, (8,)))  # TRAIN_STEP
        if step == 2 and dist.get_rank() == 0:
            print(f"evaluating at {time.time()}", flush=True)
            evaluate(model)


if __name__ == "__main__":
    loom.launch(main)
