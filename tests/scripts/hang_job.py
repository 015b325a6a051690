"""Six ranks, three pairs, each pair with its own process group and its own way to hang.

Ranks 0 and 1: the chief (rank 0) evaluates alone, with an all-reduce inside.
Ranks 2 and 3: rank 3 skips one all-reduce.
Ranks 4 and 5: rank 5 never leaves a Python loop.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import loom

strategy = loom.MirroredStrategy()
rank = dist.get_rank()
# The first pair's collectives time out as --timeout says; the others' wait longer, so that when
# the records are compared every pair has reached its hang and none has left it by timing out.
groups = [dist.new_group(pair, timeout=timedelta(seconds=10 if pair == [0, 1] else 20)) for pair in ([0, 1], [2, 3], [4, 5])]
group = groups[rank // 2]
grad = torch.ones(4)
dist.barrier()  # the three pairs start together, so all three hang by the first timeout


def evaluate():
    metric = torch.ones(1)
    dist.all_reduce(metric, group=group)  # EVAL_ALL_REDUCE


def spin():
    while True:
        time.sleep(0.05)  # LOOP_LINE


for step in range(4):
    if rank == 3 and step == 2:
        continue
    if rank == 5 and step == 2:
        spin()
    dist.all_reduce(grad, group=group)  # TRAIN_ALL_REDUCE
if rank == 0:
    evaluate()
dist.barrier(group=group)  # END_BARRIER
