"""Two processes train; after step 2 the chief evaluates alone, the usual chief-only code.

argv: sharded, mirrored or pipeline. Under Sharded the evaluation's forward all-gathers meet
the other replica's training ones, and the job hangs; under Mirrored its metric's all-reduce
meets the other's gradient all-reduce, of another size, and gloo aborts the chief. Under
Pipeline (two stages, one replica) the chief's forward sends to a stage that waits in its
training step, and the job hangs. The chief prints when it starts to evaluate.
"""

import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import loom


def evaluate(model, strategy):
    with torch.no_grad():
        loss = model(torch.randn(8, 16)).sum()  # EVAL_FORWARD
    return strategy.reduce(loss, "mean")  # EVAL_REDUCE


def main():
    strategy = {"sharded": loom.ShardedStrategy, "mirrored": loom.MirroredStrategy, "pipeline": loom.PipelineStrategy}[sys.argv[1]]()
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=0.1))
    train = strategy.train_step(model, F.cross_entropy, opt)
    for step in range(6):
        train(torch.randn(8, 16), torch.randint(0, 4, (8,)))  # TRAIN_STEP
        if step == 2 and strategy.is_chief:
            print(f"evaluating at {time.time()}", flush=True)
            evaluate(model, strategy)


if __name__ == "__main__":
    loom.launch(main)
