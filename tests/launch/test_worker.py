"""The worker bootstrap: the program's exit status survives, and nothing written is lost."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT


def run_worker(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(body)
    return subprocess.run([sys.executable, "-m", "loom.launch.worker", str(script), "arg1"], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(
    "body, code",
    [
        ("import sys\nassert sys.argv[1] == 'arg1' and __name__ == '__main__'\n", 0),
        ("raise SystemExit(3)\n", 3),
        ("raise SystemExit('bad config')\n", 1),
        ("raise ValueError('broken')\n", 1),
    ],
)
def test_exit_status_is_the_programs(tmp_path, body, code):
    done = run_worker(tmp_path, body)
    assert done.returncode == code, done.stderr
    if "ValueError" in body:
        assert "ValueError: broken" in done.stderr and "Traceback" in done.stderr


def test_unclosed_files_and_atexit_handlers_are_flushed(tmp_path):
    out = tmp_path / "out.txt"
    done = run_worker(
        tmp_path,
        f"import atexit\nlog = open({str(out)!r}, 'w')\nlog.write('kept')\n"
        f"atexit.register(lambda: open({str(out) + '.atexit'!r}, 'w').write('ran'))\n",
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "kept"
    assert (tmp_path / "out.txt.atexit").read_text() == "ran"
