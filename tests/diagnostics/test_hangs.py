"""A hung job's final message says where each rank is and why, from the ranks' collective records."""

import re
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
    frames = namespace["deep"](30)  # CALL_HERE
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
