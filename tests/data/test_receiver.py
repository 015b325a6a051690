"""The thread that takes process workers' batches in while the loop trains (loom/data/receiver.py)."""

import gc
import multiprocessing
import os
import signal
import threading
import time
import weakref

import pytest
import torch

import loom.data as ld
from loom.data.receiver import Receiver


def _counting(n, taken, finished=None, fail_at=None):
    try:
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"item {i} is bad")
            taken.append(i)
            yield i
    finally:
        if finished is not None:
            finished.set()


def test_items_come_in_order_and_the_end_stays_the_end():
    received = Receiver(_counting(5, []), depth=2)
    assert list(received) == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):  # asked again (the loader takes the stream's end twice): no hang
        next(received)


def _settled(taken, at_least):
    """The count once the thread has taken ``at_least`` and a while has passed without more."""
    deadline = time.monotonic() + 10
    while len(taken) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    return len(taken)


def test_it_reads_no_more_than_its_depth_ahead_of_the_loop():
    taken = []
    received = Receiver(_counting(100, taken), depth=2)
    assert _settled(taken, 3) == 3, taken  # two queued and one waiting in the thread
    assert next(received) == 0
    assert _settled(taken, 4) == 4


def test_an_error_is_raised_in_the_loops_thread_after_the_items_before_it():
    received = Receiver(_counting(10, [], fail_at=3), depth=4)
    assert [next(received) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="item 3 is bad"):
        next(received)
    with pytest.raises(StopIteration):
        next(received)


def test_close_waits_until_the_thread_is_out_of_the_iterator():
    inside, leave = threading.Event(), threading.Event()

    def slow():
        yield 0
        inside.set()
        leave.wait()  # a DataLoader waiting for its next batch
        yield 1

    received = Receiver(slow(), depth=1)
    assert next(received) == 0
    assert inside.wait(5)
    closing = threading.Thread(target=received.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # still inside: the iterator may not be reset yet
    leave.set()
    closing.join(5)
    assert not closing.is_alive()


def test_a_dropped_receiver_lets_go_of_what_it_read():
    """Its thread holds the DataLoader's iterator: were it to wait on a full queue for ever, the
    loader's worker processes would outlive the loader."""
    finished = threading.Event()
    received = Receiver(_counting(1000, [], finished), depth=1)
    next(received)
    del received
    gc.collect()
    assert finished.wait(5), "the thread still holds the iterator"


def test_a_dropped_receiver_whose_reading_raised_lets_go_of_the_iterator_without_the_cyclic_collector():
    """The error in its queue once held, through its traceback, the frame that held the queue: a
    cycle that kept a DataLoader iterator (and its worker processes) alive until a collection."""

    class Failing:
        def __iter__(self):
            return self

        def __next__(self):
            raise RuntimeError("a worker died")

    failing = Failing()
    gone = weakref.ref(failing)
    gc.disable()
    try:
        received = Receiver(iter(failing), depth=1)
        del failing
        received._thread.join(10)
        del received
        assert gone() is None
    finally:
        gc.enable()


def _slowly(x):
    time.sleep(0.005)
    return x


def _loader(n=400):
    return ld.from_tensors(torch.arange(n)).map(_slowly, num_parallel=2, method="process").batch(8).prefetch().loader()


def _children():
    return multiprocessing.active_children()


def test_a_killed_worker_is_named_at_once_and_the_next_pass_starts_new_workers():
    """The other worker's idle tasks kept torch from ever noticing; the receiver then waited for
    the lost batch for ever, and iterating again hung joining it."""
    loader = _loader()
    got = []
    with pytest.raises(RuntimeError, match="worker"):
        for batch in loader:
            got += batch.tolist()
            if len(got) == 40:
                os.kill(_children()[0].pid, signal.SIGKILL)
    started = time.monotonic()
    for batch in loader:  # the rest of the pass, from where the loop was
        got += batch.tolist()
    assert sorted(got) == list(range(400)) and time.monotonic() - started < 30


def test_a_dropped_loader_ends_its_workers_even_with_a_batch_lost():
    others = set(_children())  # an earlier test's workers, still being ended by torch's polls, are not this loader's
    loader = _loader()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    workers = [w for w in _children() if w not in others]
    try:
        os.kill(workers[0].pid, signal.SIGKILL)  # its batch will never come
        time.sleep(1)
    except RuntimeError:  # torch's SIGCHLD handler names the dead worker wherever the loop is
        pass
    del iterator, loader
    gc.collect()
    # torch finds the dead worker and ends the others on 5 s polls of its own, which stack up on a loaded machine
    deadline = time.monotonic() + 60
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(w.is_alive() for w in workers)


def test_a_restart_mid_pass_waits_for_the_receiver_and_goes_on_exactly_once():
    loader = _loader(200)
    first = [b.tolist() for _, b in zip(range(5), loader)]
    state = loader.state_dict()
    skipped = [b.tolist() for _, b in zip(range(3), loader)]  # read on, then go back
    loader.load_state_dict(state)
    rest = [b.tolist() for b in loader]
    assert skipped == rest[:3] and sum(first + rest, []) == list(range(200))


def test_a_forked_process_is_told_to_make_its_own_loader():
    """The receiving thread does not cross a fork: the child would wait for ever for its batches."""
    iterator = iter(_loader(80))
    next(iterator)
    pid = os.fork()
    if pid == 0:  # a copy of the test process: it must never return into pytest
        code = 1
        try:
            next(iterator)
        except RuntimeError as error:
            code = 0 if "forked" in str(error) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
