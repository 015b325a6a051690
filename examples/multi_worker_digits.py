"""The same loop over several machines with MultiWorkerMirroredStrategy.

On each of two machines (node 0 at 10.0.0.1):

    loom run --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 --nproc 2 examples/multi_worker_digits.py
    loom run --nnodes 2 --node-rank 1 --master 10.0.0.1:29500 --nproc 2 examples/multi_worker_digits.py

or with a TF_CONFIG on each machine and plain `loom run examples/multi_worker_digits.py`.
Both agents may also run on one machine to try it.
"""

import loom
from one_device_digits import main

if __name__ == "__main__":
    main(loom.MultiWorkerMirroredStrategy())
