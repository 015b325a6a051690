import json
import re
import subprocess
import sys

import pytest

from loom.launch import torchrun
from loom.launch.cli import main
from loom.launch.shadow import shadowing_folder
from loom.launch.torchrun import LaunchOptions, torchrun_argv, worker_environment
from tests.helpers import ROOT, job_env


def test_env_shows_what_a_launch_resolves(capsys, monkeypatch):
    config = {"cluster": {"worker": ["10.1.0.1:2300", "10.1.0.2:2300"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert main(["env", "--nproc", "3", "--threads", "5"]) == 0
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["cluster from"] == "TF_CONFIG"
    assert rows["nodes"] == "2" and rows["this node's rank"] == "1"
    assert rows["master"] == "10.1.0.1:2300" and rows["hosts"] == "10.1.0.1, 10.1.0.2"
    assert rows["world size"] == "6" and rows["threads per process"] == "5"


def test_tf_config_on_cpu_runs_one_process_per_worker_and_says_why(capsys, monkeypatch):
    config = {"cluster": {"worker": ["10.1.0.1:2300", "10.1.0.2:2300"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    monkeypatch.setattr(torchrun, "cuda_count", lambda: 0)
    assert main(["env"]) == 0
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["processes per node"] == "1" and rows["world size"] == "2"
    assert rows["replicas"] == "2 replicas = 2 nodes x 1 process (TF_CONFIG: one process per worker on CPU; --nproc N to change)"
    assert LaunchOptions(nproc=3).replicas() == "6 replicas = 2 nodes x 3 processes (--nproc 3)"


def test_env_shows_a_parameter_server_task(capsys, monkeypatch):
    config = {"cluster": {"ps": ["10.1.0.1:2300"], "chief": ["10.1.0.2:1"], "worker": ["10.1.0.3:1"]}, "task": {"type": "ps", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert main(["env"]) == 0
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["cluster from"] == "TF_CONFIG (parameter servers)"
    assert rows["this task"] == "ps 0, listening on 10.1.0.1:2300"
    assert rows["workers"] == "2 (worker 0 is the chief)"


def test_launch_arguments_for_one_node_and_many():
    assert torchrun_argv(LaunchOptions(nproc=2), ["t.py"])[-4:] == ["--standalone", "-m", "loom.launch.worker", "t.py"]
    argv = torchrun_argv(LaunchOptions(nproc=2, nnodes=2, node_rank=1, master="10.0.0.9:1234"), ["-m", "pkg.train", "--lr", "1"])
    assert argv[argv.index("--node-rank") + 1] == "1" and argv[argv.index("--master-addr") + 1] == "10.0.0.9"
    assert argv[-6:] == ["-m", "loom.launch.worker", "-m", "pkg.train", "--lr", "1"]


def test_threads_are_split_between_local_processes(monkeypatch):
    monkeypatch.setattr("loom.devices.available_cores", lambda: 16)
    default = worker_environment(LaunchOptions(nproc=4))
    assert (default["OMP_NUM_THREADS"], default["LOOM_HOST_PROCESSES"]) == ("4", "4")
    assert default["LOOM_THREADS"] == "auto"  # each worker divides the cores among the loom processes it finds
    given = worker_environment(LaunchOptions(nproc=4, threads=2, timeout=9))
    assert (given["OMP_NUM_THREADS"], given["LOOM_THREADS"]) == ("2", "2")
    assert worker_environment(LaunchOptions(nproc=4, timeout=9))["LOOM_TIMEOUT"] == "9"


def test_bad_cli_input_is_one_line(capsys):
    assert main(["env", "--nnodes", "2", "--node-rank", "5", "--master", "h:1"]) == 2
    assert capsys.readouterr().err == "loom: error: node rank 5 is outside 0..1 for a job of 2 node(s) (flags); give each node a distinct rank below nnodes\n"
    assert main(["run", "--workers", "2", "x.py"]) == 2
    assert capsys.readouterr().err.startswith("loom: error: --workers is for parameter-server jobs: add --ps N (one machine) or --ps-hosts")
    assert main(["run", "--ps", "1", "--ps-hosts", "h:1", "--role", "ps", "x.py"]) == 2
    assert "across machines use --ps-hosts and --role instead" in capsys.readouterr().err


TIMEOUTS = {"LOOM_TIMEOUT": 300, "LOOM_HEARTBEAT_TIMEOUT": 30, "LOOM_HANG_CHECK": 15, "LOOM_SAVE_TIMEOUT": 60, "LOOM_RENDEZVOUS_REPORT": 30}


@pytest.mark.parametrize("name", TIMEOUTS)
@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "ten"])
def test_a_timeout_that_cannot_bound_a_wait_is_one_line_naming_it(name, value, capsys, monkeypatch):
    # nan passed the old check and switched the heartbeat off; a job (here, one that would fail
    # on its missing script) must not start at all.
    monkeypatch.setenv(name, value)
    assert main(["run", "--nproc", "1", "missing.py"]) == 2
    line = f"{name}={value!r} is not a finite positive number of seconds; unset it for the default ({TIMEOUTS[name]})"
    assert capsys.readouterr().err == f"loom: error: {line}\n"


@pytest.mark.parametrize("value", ["nan", "inf", "-5"])
def test_a_timeout_flag_that_cannot_bound_a_wait_is_one_line(value, capsys):
    assert main(["run", "--nproc", "1", "--timeout", value, "missing.py"]) == 2
    assert capsys.readouterr().err == f"loom: error: --timeout must be a finite positive number of seconds, got {float(value)}\n"


def test_a_job_across_machines_needs_its_token(capsys, monkeypatch):
    monkeypatch.delenv("LOOM_PS_TOKEN", raising=False)
    assert main(["run", "--ps-hosts", "127.0.0.1:1", "--workers", "1", "--role", "worker", "x.py"]) == 2
    assert capsys.readouterr().err.startswith("loom: error: LOOM_PS_TOKEN is not set: a parameter-server job across machines admits only its own processes; set the same secret")


def test_a_folder_named_loom_where_the_job_starts_is_one_line(tmp_path):
    """A copy of a loom package there: the workers would import it; the launcher (started with
    -P, so it imports the real one) says so before it starts them."""
    (tmp_path / "loom").mkdir()
    (tmp_path / "loom" / "__init__.py").write_text("")
    (tmp_path / "train.py").write_text("import loom\nloom.OneDeviceStrategy()\n")
    done = subprocess.run([sys.executable, "-P", "-m", "loom.launch.cli", "run", "--nproc", "1", "train.py"],
                          cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (
        f"loom: error: {tmp_path / 'loom'} shadows the loom package: workers start in {tmp_path} and would import it "
        f"instead of {ROOT / 'loom'}; start the job from another folder, or rename that directory\n"
    )


def test_a_plain_folder_named_loom_shadows_only_an_editable_install(tmp_path):
    """A clone's root (no __init__.py): Python's path search prefers a real package later on the
    path, but not one that only an editable install's finder knows."""
    (tmp_path / "loom").mkdir()
    assert shadowing_folder(tmp_path, [str(ROOT)]) is None
    assert shadowing_folder(tmp_path, []) == tmp_path / "loom"
    assert shadowing_folder(ROOT, []) is None  # the real package itself
