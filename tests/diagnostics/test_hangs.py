"""A hung job's final message says where each rank is and why, from the ranks' collective records."""

import re
import time
from pathlib import Path

import pytest

from loom.comm.hangs import explain, rank_condition
from tests.helpers import SCRIPTS, loom_run

pytestmark = pytest.mark.xdist_group("hangs")

SCRIPT = SCRIPTS / "hang_job.py"


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(SCRIPT.read_text().splitlines(), 1) if marker in text)


@pytest.fixture(scope="session")
def final_line() -> str:
    """The last line of one six-rank job in which three pairs of ranks hang three ways at once.

    Only the first pair's collective times out (10 s): a pair that six processes on two cores
    slowed down has reached its hang by then, and no pair's collective has ended by timing out
    as the records are compared (which pair found the hang first once decided what they said)."""
    job = loom_run(["run", "--nproc", "6", "--threads", "1", "--timeout", "10", str(SCRIPT)], timeout=240)
    assert job.returncode != 0
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("loom: job failed: rank ") and " failed: HangError: " in line, job.stderr[-3000:]
    return line


def test_a_skipped_all_reduce_names_the_rank_and_both_call_sites(final_line):
    train, barrier = line_of("TRAIN_ALL_REDUCE"), line_of("END_BARRIER")
    # gloo may complete rank 2's all-reduce against rank 3's barrier: then it "ran", and the
    # records say where the collectives first differed rather than where they are out of step.
    assert re.search(
        rf"(collectives out of step|the ranks' collectives first differed) at #4: rank 3 (is in|ran) barrier #4 of group 2 \(hang_job.py:{barrier}\) "
        rf"while rank 2 (is in|ran) all_reduce #4 of group 2 \(hang_job.py:{train}\)",
        final_line,
    ), final_line


def test_a_rank_looping_in_python_is_named_with_the_looping_line(final_line):
    assert f"rank 5 never reached all_reduce #3 of group 3 (hang_job.py:{line_of('TRAIN_ALL_REDUCE')}); its Python stack: " in final_line, final_line
    assert f"hang_job.py:{line_of('LOOP_LINE')} in spin" in final_line
    assert final_line.count("never reached") == 1  # ranks of the other groups are not behind in this one


def test_a_collective_run_by_the_chief_only_is_named_as_such(final_line):
    eval_line, barrier, guard = line_of("EVAL_ALL_REDUCE"), line_of("END_BARRIER"), line_of("if rank == 0:")
    # gloo may complete rank 0's all-reduce against rank 1's barrier: then both "ran", and the
    # chief-only collective is named as one that ran on rank 0 only.
    assert re.search(
        rf"rank 1 (is in|ran) barrier #5 of group 1 \(hang_job.py:{barrier}\) "
        rf"while rank 0 (is in|ran) all_reduce #5 of group 1 \(hang_job.py:{eval_line}\)",
        final_line,
    ), final_line
    assert (
        f"all_reduce at hang_job.py:{eval_line} runs under `if rank == 0:` (hang_job.py:{guard}), on some ranks only" in final_line
        or f"all_reduce at hang_job.py:{eval_line} ran on rank 0 only, never on rank 1" in final_line
    ), final_line


def call(seq, op, line, done=True, group="0", shapes=((4,),)):
    return {"group": group, "seq": seq, "op": op, "shapes": [list(s) for s in shapes], "dtypes": ["Float"],
            "frames": [{"file": "/x/train.py", "line": line, "name": "f"}], "done": done}  # fmt: skip


def record(rank, calls, finished=False):
    return {"rank": rank, "host": "h", "pid": 1, "calls": calls, "stack": [], "finished": finished}


def test_the_odd_rank_out_is_named_first_against_the_others():
    ok = [call(1, "all_reduce", 80), call(2, "barrier", 95, done=False)]
    odd = [call(1, "all_reduce", 80), call(2, "all_reduce", 88, done=False)]
    records = {0: record(0, ok), 1: record(1, odd), 2: record(2, ok), 3: record(3, ok)}
    text = explain(records, 4)
    assert text.startswith("collectives out of step at #2: rank 1 is in all_reduce #2 (train.py:88) while ranks 0, 2, 3 are in barrier #2 (train.py:95)")


def test_a_rank_waiting_ahead_is_the_target_though_its_previous_collective_is_not_yet_marked_done():
    # Under load a rank's record can show its last collective in flight before the one before it is marked done.
    waiting = [call(1, "all_reduce", 10), call(2, "all_reduce", 10, done=False), call(3, "all_reduce", 10, done=False)]
    looping = [call(1, "all_reduce", 10), call(2, "all_reduce", 10)]
    text = explain({0: record(0, waiting), 1: record(1, looping)}, 2)
    assert "rank 1 never reached all_reduce #3 (train.py:10)" in text, text


def test_a_collective_completed_on_some_ranks_only_is_named():
    # gloo matched the chief's evaluation all-reduce with the others' training one: no hang yet, wrong sums.
    chief = [call(1, "all_reduce", 10), call(2, "all_reduce", 20), call(3, "all_reduce", 10), call(4, "all_reduce", 10, done=False)]
    other = [call(1, "all_reduce", 10), call(2, "all_reduce", 10), call(3, "all_reduce", 10), call(4, "barrier", 30, done=False)]
    text = explain({0: record(0, chief), 1: record(1, other)}, 2)
    assert "the ranks' collectives first differed at #2: " in text
    assert "all_reduce at train.py:20 ran on rank 0 only, never on rank 1: every rank must run the same collectives" in text


def test_a_call_completed_against_another_op_is_not_called_a_link_down():
    # gloo completed rank 0's all-reduce against rank 1's barrier; rank 0 then failed, rank 1 waits.
    ran = [call(1, "all_reduce", 10), call(2, "all_reduce", 10)]
    waits = [call(1, "all_reduce", 10), call(2, "barrier", 30, done=False)]
    text = explain({0: record(0, ran), 1: record(1, waits)}, 2)
    assert text == "the ranks' collectives first differed at #2: rank 1 is in barrier #2 (train.py:30) while rank 0 ran all_reduce #2 (train.py:10)"


def test_a_send_and_its_receive_are_not_a_certain_hang():
    # What the main thread's standing still checks for: a pipeline's stages send and receive by
    # design, and a rank behind in its Python may yet come.
    sender = [call(1, "all_reduce", 10), call(1, "send", 40), call(2, "all_reduce", 10, done=False)]  # p2p has numbers of its own
    receiver = [call(1, "all_reduce", 10), call(1, "recv", 44)]
    records = {0: record(0, sender), 1: record(1, receiver)}
    assert explain(records, 2, certain=True) is None
    assert "rank 1 never reached all_reduce #2 (train.py:10)" in explain(records, 2)


def test_ranks_in_different_collectives_are_a_certain_hang():
    records = {0: record(0, [call(1, "all_reduce", 10, done=False)]), 1: record(1, [call(1, "barrier", 30, done=False)])}
    assert explain(records, 2, certain=True).startswith("collectives out of step at #1: ")


def test_ranks_that_agree_and_wait_nowhere_give_no_finding():
    calls = [call(1, "all_reduce", 10), call(2, "all_reduce", 10)]
    assert explain({0: record(0, calls), 1: record(1, calls)}, 2) is None


def test_rank_condition_reads_the_if_around_a_call(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("if strategy.is_chief:\n    evaluate()\nelse:\n    pass\nif x > 1:\n    evaluate()\n")
    assert rank_condition(str(path), 2) == ("`if strategy.is_chief:`", 1)
    assert rank_condition(str(path), 6) is None


def test_another_thread_reads_the_main_threads_stack_in_place():
    import threading

    from loom.comm.stacks import describe, main_frames

    seen, started = [], threading.Event()

    def read():
        started.wait()
        seen.append(describe(main_frames()))

    reader = threading.Thread(target=read)
    reader.start()
    started.set()
    while reader.is_alive():  # READ_HERE
        pass
    here = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# READ_HERE"))
    assert seen[0].startswith(f"test_hangs.py:{here} in test_another_thread_reads_the_main_threads_stack_in_place (while reader.is_alive()"), seen


def test_the_users_line_is_found_below_many_of_looms_frames():
    """A rank reporting its own hang is deeper than the innermost frames inside loom and torch."""
    import loom
    from loom.comm.stacks import describe, main_frames

    inside_loom = str(Path(loom.__file__).parent / "deep.py")  # code compiled under loom's folder counts as loom's
    namespace: dict = {"main_frames": main_frames}
    exec(compile("def deep(n):\n    return main_frames() if n == 0 else deep(n - 1)\n", inside_loom, "exec"), namespace)
    # deeper than main_frames' innermost 40 frames
    frames = namespace["deep"](60)  # CALL_HERE
    here = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# CALL_HERE"))
    assert describe(frames).startswith(f"test_hangs.py:{here} in test_the_users_line_is_found_below_many_of_looms_frames"), describe(frames)


def test_loom_stacks_prints_where_each_rank_of_a_running_job_is(capsys):
    import threading
    import time

    import torch.distributed as dist

    from loom.comm.health import PREFIX
    from loom.comm import collective_log
    from loom.comm.stacks import stacks_command
    from tests.helpers import free_port

    port, prefix = free_port(), f"{PREFIX}/0"
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    loop = {"file": "/x/train.py", "line": 95, "name": "<module>", "code": "dist.barrier()"}
    records = {
        0: {**record(0, [call(1, "all_reduce", 80), call(2, "barrier", 95, done=False)]), "stack": [loop]},
        1: record(1, [call(1, "all_reduce", 80), call(2, "all_reduce", 88, done=False)]),
    }
    for r in records:
        store.set(f"{prefix}/member/{r}", "{}")
    stop = threading.Event()

    def heartbeat(rank):  # what each rank's heartbeat thread does
        client, answered = dist.TCPStore("127.0.0.1", port, is_master=False), 0
        while not stop.is_set():
            answered = collective_log.answer(client, prefix, answered, lambda: records[rank])
            time.sleep(0.05)

    threads = [threading.Thread(target=heartbeat, args=(r,)) for r in records]
    for t in threads:
        t.start()
    try:
        assert stacks_command(f"127.0.0.1:{port}") == 0
    finally:
        stop.set()
        for t in threads:
            t.join()
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["rank 0 (h, pid 1): in barrier #2 (train.py:95)", "  /x/train.py:95 in <module>", "      dist.barrier()"]
    assert out[3] == "rank 1 (h, pid 1): in all_reduce #2 (train.py:88)"
    assert out[-1] == "loom: collectives out of step at #2: rank 1 is in all_reduce #2 (train.py:88) while rank 0 is in barrier #2 (train.py:95)"


CHIEF_ONLY = SCRIPTS / "chief_only_job.py"


def chief_only(strategy: str) -> tuple[str, str, float]:
    """stderr's lines from rank 1's verdict on, the last line, and the seconds from the chief's divergence to the job's end."""
    job = loom_run(["run", "--nproc", "2", "--threads", "1", str(CHIEF_ONLY), strategy], timeout=150)
    ended = time.time()
    assert job.returncode != 0
    diverged = float(re.search(r"evaluating at ([\d.]+)", job.stdout).group(1))
    return job.stderr, job.stderr.strip().splitlines()[-1], ended - diverged


def chief_line(marker: str) -> int:
    return next(i for i, text in enumerate(CHIEF_ONLY.read_text().splitlines(), 1) if marker in text)


def test_a_chief_only_evaluation_under_sharded_is_named_within_60_s_not_at_the_timeout():
    # The collective timeout is the default 300 s: the main thread standing still for
    # LOOM_HANG_CHECK (15 s) has the records compared, and they show the divergence.
    stderr, last, seconds = chief_only("sharded")
    assert seconds < 60, f"named {seconds:.0f}s after the divergence"
    evaluate, train, guard = chief_line("EVAL_FORWARD"), chief_line("TRAIN_STEP"), chief_line("if step == 2")
    assert last.startswith("loom: job failed: rank ") and " failed: HangError: " in last, stderr[-3000:]
    assert re.search(rf"rank 1 ran all_gather #\d+ \(chief_only_job.py:{train}\) while rank 0 ran all_gather #\d+ \(chief_only_job.py:{evaluate}\)", last), last
    assert f"all_gather at chief_only_job.py:{evaluate} runs under `if step == 2 and strategy.is_chief:` (chief_only_job.py:{guard}), on some ranks only" in last, last


def test_a_chief_only_evaluation_under_a_pipeline_is_named_within_60_s_with_what_a_pipeline_needs():
    # gloo's sends and receives leave no record in torch's: each stage's step and forward is one of loom's.
    stderr, last, seconds = chief_only("pipeline")
    assert seconds < 60, f"named {seconds:.0f}s after the divergence"
    evaluate, train, guard = chief_line("EVAL_FORWARD"), chief_line("TRAIN_STEP"), chief_line("if step == 2")
    assert last.startswith("loom: job failed: rank ") and " failed: HangError: " in last, stderr[-3000:]
    assert f"rank 1 is in pipeline step #4 of group pp (chief_only_job.py:{train}) while rank 0 is in pipeline forward #4 of group pp (chief_only_job.py:{evaluate})" in last, last
    assert (
        f"pipeline forward at chief_only_job.py:{evaluate} runs under `if step == 2 and strategy.is_chief:` (chief_only_job.py:{guard}), "
        "on some ranks only: under a pipeline every stage must run each forward and training step, evaluation included" in last
    ), last


def test_gloos_abort_on_a_chief_only_reduce_is_named_as_the_divergence_not_a_crash():
    stderr, last, seconds = chief_only("mirrored")
    reduce, train, guard = chief_line("EVAL_REDUCE"), chief_line("TRAIN_STEP"), chief_line("if step == 2")
    why = (
        f"the ranks' collectives did not match (gloo aborts a rank that receives more than its collective expects); "
        f"all_reduce at chief_only_job.py:{reduce} runs under `if step == 2 and strategy.is_chief:` (chief_only_job.py:{guard}), on some ranks only"
    )
    survivor = next(line for line in stderr.splitlines() if line.startswith("loom: rank 1 on "))
    assert "cannot continue: rank 0 (" in survivor and f") was aborted in all_reduce (chief_only_job.py:{reduce}) while rank 1 is in all_reduce #" in survivor, survivor
    assert f"(chief_only_job.py:{train}): {why}" in survivor, survivor
    assert last.startswith("loom: job failed: rank 0 on ") and f") was killed by SIGABRT in all_reduce (chief_only_job.py:{reduce}): {why}" in last, last
    assert last.endswith("; rank(s) 1 stopped because of it"), last
    assert seconds < 60


def test_loom_stacks_passes_over_a_worker_started_without_a_master():
    import os
    import subprocess
    import sys

    from loom.comm.stacks import WORKER, local_masters

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    stray = subprocess.Popen([sys.executable, "-c", code, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert stray.stdout.readline() == b"up\n"  # running, with its own command line
        local_masters()  # read it without a KeyError
    finally:
        stray.communicate(input=b"")
