"""Two ranks that stop matching collectives, one way per argument: skip, loop or chief_eval."""

import sys

import torch
import torch.distributed as dist

import loom

strategy = loom.MirroredStrategy()
rank = dist.get_rank()
how = sys.argv[1]
grad = torch.ones(4)


def evaluate():
    metric = torch.ones(1)
    dist.all_reduce(metric)  # EVAL_ALL_REDUCE


def spin():
    while True:  # LOOP_LINE
        pass


for step in range(4):
    if how == "skip" and rank == 1 and step == 2:
        continue
    if how == "loop" and rank == 1 and step == 2:
        spin()
    dist.all_reduce(grad)  # TRAIN_ALL_REDUCE
if how == "chief_eval" and rank == 0:
    evaluate()
dist.barrier()  # END_BARRIER
