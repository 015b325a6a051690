"""The ports of TensorFlow's distribute tutorials (examples/tf_*.py) run and learn, on few epochs and steps."""

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import LOOM, ROOT, free_port, job_env, popen, run, wait_all

EXAMPLES = ROOT / "examples"
CHEAP = {"TF_EXAMPLE_EPOCHS": "2", "OMP_NUM_THREADS": "1", "LOOM_THREADS": "1"}  # 2 epochs on the digits: accuracy 0.85-0.9


def run_example(name: str, tmp_path, **env: str) -> str:
    done = run([sys.executable, str(EXAMPLES / name)], timeout=240, env=job_env({**CHEAP, "TF_EXAMPLE_DIR": str(tmp_path), **env}))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def accuracy(pattern: str, out: str) -> float:
    found = re.findall(pattern + r"(\d\.\d+)", out)
    assert found, out
    return float(found[-1])


def test_keras_fit_with_mirrored(tmp_path):
    out = run_example("tf_keras_fit.py", tmp_path)
    assert "Number of devices: 2" in out and "Learning rate for epoch 2 is 0.002" in out
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000012", "step-00000024"]  # 1,437 digits / 128: 12 steps an epoch
    assert accuracy("Eval accuracy: ", out) >= 0.8


def test_custom_loop_with_scope_run_and_compute_average_loss(tmp_path):
    out = run_example("tf_custom_loop.py", tmp_path)
    assert "Epoch 2, Loss: " in out and (tmp_path / "step-00000000").is_dir()
    losses = [float(v) for v in re.findall(r"Epoch \d, Loss: (\d\.\d+)", out)]
    assert losses[1] < losses[0] and accuracy("Test Accuracy: ", out) >= 0.8


def test_multi_worker_with_tf_config(tmp_path):
    ports = [free_port(), free_port()]
    workers = []
    for index in range(2):
        config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
        env = job_env({**CHEAP, "TF_CONFIG": json.dumps(config), "TF_EXAMPLE_STEPS": "10", "TF_EXAMPLE_DIR": str(tmp_path / "backup")})
        workers.append(popen([*LOOM, "run", str(EXAMPLES / "tf_multi_worker.py")], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    (code0, out0, err0), (code1, out1, err1) = wait_all(workers, timeout=180)
    assert code0 == 0 and code1 == 0, err0[-2000:] + err1[-2000:]
    assert "2 workers: loss " in out0 and not (tmp_path / "backup").exists()  # the backup is removed once training ends
    assert accuracy("test accuracy: ", out0) >= 0.6  # 20 steps


@pytest.mark.xdist_group("xla")
def test_tpu_on_eight_virtual_devices(tmp_path):
    out = run_example("tf_tpu.py", tmp_path, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert "All devices: 8 replicas on 1 host(s)" in out
    assert accuracy("TPUStrategy, 8 replicas: test accuracy: ", out) >= 0.8


def test_parameter_server_coordinator_with_tf_configs_chief(tmp_path):
    """TF's cluster, each task its own ``loom run``: the chief coordinates, the two workers run the steps."""
    cluster = {role: [f"127.0.0.1:{free_port()}" for _ in range(count)] for role, count in (("chief", 1), ("worker", 2), ("ps", 1))}
    tasks = []
    for kind, index in (("ps", 0), ("chief", 0), ("worker", 0), ("worker", 1)):
        config = {"cluster": cluster, "task": {"type": kind, "index": index}}
        env = job_env({**CHEAP, "TF_EXAMPLE_EPOCHS": "4", "LOOM_PS_TOKEN": "coordinator-example", "TF_CONFIG": json.dumps(config)})
        tasks.append(popen([*LOOM, "run", str(EXAMPLES / "tf_parameter_server.py")], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    (code_ps, _, err_ps), (code0, out0, err0), *workers = wait_all(tasks, timeout=180)
    assert code_ps == 0 and code0 == 0 and all(code == 0 for code, _, _ in workers), err0[-2000:] + "".join(e[-2000:] for _, _, e in workers)
    assert [line.split(",")[0] for line in out0.splitlines()[:4]] == [f"Finished epoch {i}" for i in range(4)]
    assert accuracy("Finished epoch 3, accuracy is ", out0) >= 0.9 and float(out0.split("Final loss is ")[1]) < 0.5
    assert all(out == "" for _, out, _ in workers)  # the workers ran the steps; the coordinator printed
