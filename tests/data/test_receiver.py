"""The thread that takes process workers' batches in while the loop trains (loom/data/receiver.py)."""

import gc
import threading
import time

import pytest

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


def test_it_reads_no_more_than_its_depth_ahead_of_the_loop():
    taken = []
    received = Receiver(_counting(100, taken), depth=2)
    time.sleep(0.3)
    assert len(taken) == 3, taken  # two queued and one waiting in the thread
    assert next(received) == 0
    time.sleep(0.3)
    assert len(taken) == 4


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
