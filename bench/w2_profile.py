"""Where a W2 training step's time goes, operator by operator, in torch and in TensorFlow.

    python bench/w2_profile.py [--steps 12] [--threads 2] [--batch 256]

One process, ``--threads`` intra-op threads, fp32 and bf16-mixed (torch), the global batch of
bench/workloads.py's W2. Each operator's time is its minimum over ``--steps`` profiled steps
(robust to a busy machine's slow spells); the step's own minimum and median are beside it, with
its minor page faults. torch: ``torch.profiler`` self CPU time, contiguous, channels_last alone, loom's exact defaults,
and the fast path (channels_last with its edges, pool_before_relu, reuse_memory), fp32 and bf16-mixed. TensorFlow 2.21 (in .venv-tf, when it
exists): the same network in its own ops (Conv2D+BiasAdd+Relu, as Keras builds it, MaxPool,
Reshape, MatMul, momentum SGD), per-node times from a full trace of a graph Session, which runs
grappler's rewrites (the fused oneDNN convolution) as ``tf.function`` does. Writes
bench/results/w2_profile.json and prints the tables of bench/results/w2_profile.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TF_PYTHON = ROOT / ".venv-tf" / "bin" / "python"
# Operators (torch's aten names, TensorFlow's op types) by what they do in the step.
KINDS = [
    ("convolution forward", r"mkldnn_convolution|Conv2D$"),
    ("convolution backward", r"convolution_backward|Conv2DBackprop"),
    ("ReLU forward", r"clamp_min|aten::relu|^Relu$"),
    ("ReLU backward", r"threshold_backward|ReluGrad"),
    ("max-pool forward", r"max_pool2d_with_indices$|MaxPool$"),
    ("max-pool backward", r"max_pool2d_with_indices_backward|MaxPoolGrad"),
    ("linear forward and backward", r"addmm|aten::mm$|MatMul$"),
    ("bias gradients", r"aten::sum$|BiasAddGrad|^Sum$"),
    ("layout copies (Flatten, pool_nhwc)", r"aten::copy_|Reshape|Transpose"),
    ("zero fills", r"aten::fill_|aten::zero_|^Fill$|ZerosLike"),
    ("loss", r"softmax|nll_loss|SparseSoftmax"),
    ("optimizer", r"aten::add_|aten::mul_|_foreach|ApplyMomentum"),
]


def kind(op: str) -> str:
    name = op.split(" ")[0]
    return next((k for k, pattern in KINDS if re.search(pattern, name)), "other")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def torch_profile(steps: int, threads: int, batch: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT))
    from bench.workloads import small_cnn
    from loom.fast import allocator, exact, fast_path

    torch.set_num_threads(threads)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    results = {}
    configs = ("contiguous", "channels_last", "loom defaults (exact): pool_before_relu+pool_nhwc+reuse_memory",
               "fast path: channels_last+pool_before_relu+reuse_memory", "bf16-mixed, fast path: channels_last+pool_before_relu+reuse_memory")  # fmt: skip
    for config in configs:
        torch.manual_seed(0)
        model = small_cnn()
        if config == "channels_last":  # the layout alone, without the fast path's edges
            model = model.to(memory_format=torch.channels_last)
        if config.startswith("loom defaults"):  # what prepare applies without being asked
            exact.apply(model, None)
        if "fast path" in config:
            fast_path.apply(model, fast_path.FastPath(channels_last=True))
            fast_path.pool_before_relu(model, True)
            allocator.keep()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        bf16 = config.startswith("bf16")

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        seconds, faults = [], _faults()
        for _ in range(steps):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        faults = (_faults() - faults) / steps
        per_step = []
        for _ in range(steps):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                step()
            ops: dict[str, float] = collections.defaultdict(float)
            for e in prof.key_averages(group_by_input_shape=True):
                if e.key.startswith("aten::"):
                    ops[f"{e.key} {str(e.input_shapes)[:48]}"] += e.self_cpu_time_total / 1e3
            per_step.append(ops)
        names = set().union(*per_step)
        results[config] = {
            "step_ms_min": min(seconds) * 1e3, "step_ms_median": statistics.median(seconds) * 1e3, "faults_per_step": faults,
            "ops_ms": {n: min(s.get(n, 0.0) for s in per_step) for n in names},
        }  # fmt: skip
    return results


def tf_profile(steps: int, threads: int, batch: int) -> dict:
    """The W2 step in TensorFlow's own ops, as Keras's Conv2D(activation="relu")/Dense build it."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2

    v1 = tf.compat.v1
    v1.disable_eager_execution()
    v1.set_random_seed(0)
    x = v1.placeholder(tf.float32, (batch, 32, 32, 3))
    y = v1.placeholder(tf.int32, (batch,))
    init = v1.glorot_uniform_initializer()
    shapes = {"c1": (3, 3, 3, 32), "c2": (3, 3, 32, 64), "d1": (4096, 256), "d2": (256, 10)}
    w = {k: v1.get_variable(k, s, initializer=init) for k, s in shapes.items()}
    b = {k: v1.get_variable(k + "b", s[-1:], initializer=v1.zeros_initializer()) for k, s in shapes.items()}
    h = x
    for k in ("c1", "c2"):
        h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w[k], 1, "SAME"), b[k]))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    h = tf.reshape(h, (batch, -1))
    h = tf.nn.relu(tf.matmul(h, w["d1"]) + b["d1"])
    logits = tf.matmul(h, w["d2"]) + b["d2"]
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    train = v1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
    config = v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=1)
    with v1.Session(config=config) as session:
        session.run(v1.global_variables_initializer())
        rng = np.random.default_rng(0)
        feed = {x: rng.standard_normal((batch, 32, 32, 3), dtype=np.float32), y: rng.integers(0, 10, batch, dtype=np.int32)}
        for _ in range(3):
            session.run(train, feed)
        seconds, faults = [], _faults()
        for _ in range(steps):
            start = time.perf_counter()
            session.run(train, feed)
            seconds.append(time.perf_counter() - start)
        faults = (_faults() - faults) / steps
        per_step = []
        for _ in range(steps):
            meta = v1.RunMetadata()
            session.run(train, feed, options=v1.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE), run_metadata=meta)
            ops: dict[str, float] = collections.defaultdict(float)
            for device in meta.step_stats.dev_stats:
                for node in device.node_stats:
                    label = node.timeline_label
                    op = label.split(" = ")[1].split("(")[0] if " = " in label else node.node_name
                    ops[f"{op} {node.node_name.split(':')[0][:40]}"] += node.all_end_rel_micros / 1e3
            per_step.append(ops)
    names = set().union(*per_step)
    return {"TensorFlow": {
        "step_ms_min": min(seconds) * 1e3, "step_ms_median": statistics.median(seconds) * 1e3, "faults_per_step": faults,
        "ops_ms": {n: min(s.get(n, 0.0) for s in per_step) for n in names}, "tensorflow": tf.__version__,
    }}  # fmt: skip


def tables(results: dict) -> str:
    configs = list(results)
    rows = ["| | " + " | ".join(configs) + " |", "| --- |" + " --- |" * len(configs)]
    for label, key in (("step, min (ms)", "step_ms_min"), ("step, median (ms)", "step_ms_median"), ("minor page faults a step", "faults_per_step")):
        rows.append(f"| {label} | " + " | ".join(f"{results[c][key]:,.0f}" if key == "faults_per_step" else f"{results[c][key]:.1f}" for c in configs) + " |")
    by_kind = {c: collections.defaultdict(float) for c in configs}
    for c in configs:
        for op, ms in results[c]["ops_ms"].items():
            by_kind[c][kind(op)] += ms
    for k in [k for k, _ in KINDS] + ["other"]:
        rows.append(f"| {k} | " + " | ".join(f"{by_kind[c][k]:.1f}" for c in configs) + " |")
    rows.append("| sum of operators | " + " | ".join(f"{sum(by_kind[c].values()):.1f}" for c in configs) + " |")
    detail = []
    for c in configs:
        top = sorted(results[c]["ops_ms"].items(), key=lambda kv: -kv[1])[:14]
        detail.append(f"\n{c}, operators (min ms over the steps):\n\n" + "\n".join(f"- {ms:6.2f}  {op}" for op, ms in top))
    return "\n".join(rows) + "\n" + "\n".join(detail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tf", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tf:
        print(json.dumps(tf_profile(args.steps, args.threads, args.batch)))
        return
    results = {}
    if TF_PYTHON.exists():
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run([str(TF_PYTHON), __file__, "--tf", *sys.argv[1:]], env=env, capture_output=True, text=True, check=True)
        results.update(json.loads(done.stdout.strip().splitlines()[-1]))
    results = {**torch_profile(args.steps, args.threads, args.batch), **results}
    out = ROOT / "bench" / "results" / f"w2_profile_{args.threads}t_{args.batch}.json"
    out.write_text(json.dumps({"threads": args.threads, "batch": args.batch, "load_average": os.getloadavg(), "results": results}, indent=1))
    print(f"W2 step, 1 process, {args.threads} threads, batch {args.batch}, load {os.getloadavg()[0]:.1f}; operators' minimum ms over {args.steps} steps\n")
    print(tables(results))
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
