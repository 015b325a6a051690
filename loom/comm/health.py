"""Name the rank that died or stopped, instead of waiting on it forever.

Each rank registers its host and pid in the job's store (held by torchrun's agent, so it
outlives any worker), beats a counter there, and posts a notice when it fails with an
exception. Each rank watches a few peers round a ring (``ring``): the one that finds a peer
gone or silent raises the alarm, which every rank hears at once. When a collective breaks,
or the agent tears the job down, a survivor reads the records and says which rank failed
and where. When every rank is alive but a collective timed out, the first rank to see it
compares every rank's record of its collectives (``collective_log``, ``hangs``) and says
where they part. It need not wait for the timeout: when a rank's main thread has not moved
for ``LOOM_HANG_CHECK`` seconds, its heartbeat thread compares the records, and stops the job
if they show a hang that no wait can end (ranks in different collectives, one run under
``if is_chief:`` on the chief only).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
import types
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from loom.cluster import ClusterSpec, seconds_from_env
from loom.comm import preemption, ring
from loom.errors import LoomError, RankFailureError

PREFIX = "loom/health"
# Silences are measured on a clock that stops while this process does not run (SIGSTOP, a paused
# VM): a ticker that wakes over STALL seconds late counts all of its lateness as such a stop, so a
# rank that comes back names neither its store nor its peers for its own silence.
TICK, STALL = 0.1, 1.0
FAULT_DUMP_ENV = "LOOM_FAULT_DUMPS"  # a folder, set by loom's launcher, which reads the dumps there


def fault_path(folder: str, rank: int) -> str:
    """Where rank ``rank`` leaves its Python stacks when a fatal signal ends it."""
    return os.path.join(folder, f"rank-{rank}.fault")


class HealthMonitor:
    """Heartbeats and failure notices for one rank; ``diagnose()`` names failed peers."""

    def __init__(self, spec: ClusterSpec, interval: float = 1.0, store_timeout: float = 10.0) -> None:
        self.spec = spec
        self.interval = interval
        self.silence_limit = resolve_silence_limit()
        self.hang_check = resolve_hang_check()
        self.host = spec.host
        self._store_timeout = timedelta(seconds=store_timeout)
        self._store = self._connect()
        self._stopped_for, self._ticked = 0.0, time.monotonic()  # seconds this process did not run, and the last tick (``_tick``)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self._previous_excepthook = sys.excepthook
        self._failed_in_last = False  # this rank's newest collective raised: its record says it is stuck there
        # This rank is failing and says why: the agent's SIGTERM must not relabel it a victim,
        # nor cut it off before its error is recorded; it ends the rank once the error is.
        self._failing = self._reported = self._terminated = False
        self._leaving = threading.Lock()  # held by the thread that says the last line and ends the rank

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(
            self.spec.master_addr,
            self.spec.master_port,
            is_master=False,
            timeout=self._store_timeout,
            wait_for_workers=False,
        )

    def _key(self, kind: str, rank: int) -> str:
        return f"{self._namespace()}/{kind}/{rank}"

    def _namespace(self) -> str:
        # One namespace per attempt: after an elastic restart, the last attempt's dead are not ours.
        return f"{PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def start(self) -> None:
        from loom.comm import collective_log  # imported on use: its stacks module reads this one's PREFIX

        collective_log.arm()
        self.watch(**self._dump_faults())
        sys.excepthook = self._excepthook
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def watch(self, **member: str) -> None:
        """Register this rank (with ``member``'s extra fields), beat, watch its peers and listen for
        the alarm: ``start`` without the process's hooks, so that several simulated ranks can share
        one process (``bench/health_scale.py``)."""
        me = {"host": self.host, "pid": os.getpid(), **member}
        self._store.set(self._key("member", self.spec.rank), json.dumps(me))
        self._contact = self._running()
        threading.Thread(target=self._tick, name="loom-ticker", daemon=True).start()
        self._thread = threading.Thread(target=self._beat, name="loom-heartbeat", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch_contact, name="loom-watchdog", daemon=True).start()
        self._listener = threading.Thread(target=self._listen, name="loom-alarm", daemon=True)
        self._listener.start()

    def _dump_faults(self) -> dict[str, str]:
        """Have a fatal signal (gloo's abort on a collective mismatch) leave this rank's Python stacks in a file
        the launcher and the peers on this host read, when loom's launcher asked for it; its path, for the peers."""
        folder = os.environ.get(FAULT_DUMP_ENV)
        if not folder or not os.path.isdir(folder) or faulthandler.is_enabled():
            return {}
        path = fault_path(folder, self.spec.rank)
        self._fault_file = open(path, "w")  # kept open: faulthandler writes to its descriptor
        faulthandler.enable(file=self._fault_file, all_threads=True)
        return {"faults": path}

    def stop(self) -> None:
        try:  # a rank that finished is not a rank that stopped responding
            self._publish_record(finished=True)  # what it did last, for a peer left waiting on it
            self._store.set(self._key("done", self.spec.rank), "1")
        except Exception:
            pass
        self._stop.set()
        if self._listener is not None:
            try:
                ring.stop_listening(self._store, self._namespace(), self.spec.rank)
            except Exception:
                pass
            self._listener.join(timeout=2 * self.interval)
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
            self._thread = None
        sys.excepthook = self._previous_excepthook

    def _beat(self) -> None:
        """Beat, and watch this rank's peers on the ring: one silent for ``silence_limit`` stops
        the job now, not at the collective timeout; so does a hang the records show once the
        main thread has stood still for ``hang_check``."""
        store: dist.TCPStore | None = None  # a client of its own (the main thread may be using the other), connected
        # in the loop: a connect that times out on a busy machine is tried again, not the end of this rank's beats
        key = self._key("beat", self.spec.rank)
        heard: dict[int, tuple[int, float]] = {}  # rank -> (beats, when they last changed)
        members: dict[int, dict] = {}  # rank -> host and pid, read once each
        finished: set[int] = set()  # ranks seen done: no longer watched
        answered = 0  # requests for this rank's record of collectives
        main, still_since, checked = None, self._running(), 0.0  # where the main thread is, since when
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._connect()
                store.add(key, 1)
                answered = self._answer_record_requests(store, answered)
                silent = self._silent_peers(store, heard, members, finished)
                self._contact = now = self._running()
                frame = sys._current_frames().get(threading.main_thread().ident)
                here = (id(frame), frame.f_lasti) if frame is not None else None
                if here != main:
                    main, still_since = here, now
                elif now - still_since >= self.hang_check and now - checked >= self.hang_check:
                    checked = now
                    self._check_for_hang(store)
            except Exception:  # unreachable: _watch_contact decides when that is fatal
                silent, store = [], None  # a client whose request timed out may be out of step: connect again
            if silent and not self._stop.is_set() and not self._failing:  # a failing rank says why itself
                self._give_up("; ".join(silent))
            self._stop.wait(self.interval)

    def _listen(self) -> None:
        """Wait for the alarm another rank raises (a peer it watches is gone, or the job hangs): this
        rank may wait in C++, where no exception reaches it."""
        try:
            reason = ring.listen(self._connect(), self._namespace(), self.spec.rank)
        except Exception:  # the store is unreachable: _watch_contact decides when that is fatal
            return
        if not self._stop.is_set() and not self._failing:  # a failing rank says why itself
            self._give_up(reason)

    def _check_for_hang(self, store: dist.TCPStore) -> None:
        """The main thread has stood still: if every rank's record shows a hang no wait can end, fail with it now."""
        from loom.comm import collective_log
        from loom.comm.hangs import HangError, explain

        prefix, world = self._namespace(), self.spec.world_size
        asked = collective_log.request(store, prefix)
        collective_log.publish(store, prefix, self._record(), asked)
        records = collective_log.collect(store, prefix, world, asked, wait=3 * self.interval)
        found = explain(records, world, certain=True) if len(records) == world else None
        if not found or self._failing or store.add(self._key("hang-claim", 0), 1) != 1:
            return  # nothing certain yet, or another rank reports it (its finding reaches this one)
        self._failing = True
        store.set(self._key("hang", 0), json.dumps({"rank": self.spec.rank, "found": found}))
        ring.raise_alarm(store, prefix, world, _hung(self.spec.rank, found))
        self._fail(HangError(found), store)

    def _fail(self, error: LoomError, store: dist.TCPStore) -> NoReturn:
        """Fail this rank with ``error`` from the heartbeat thread, as if the main thread, which is
        stuck, had raised it there: recorded for the launcher (or printed) with the main thread's stack."""
        store.set(self._key("failed", self.spec.rank), "".join(traceback.format_exception_only(type(error), error)).strip()[:500])
        try:
            raise error
        except LoomError as raised:
            raised.__traceback__ = _traceback_of(sys._current_frames().get(threading.main_thread().ident))
            self._previous_excepthook(type(raised), raised, raised.__traceback__)
        self._leave(None, 1)

    def _watch_contact(self) -> None:
        """A store call can block for good when this host is cut off: watch from another thread."""
        while not self._stop.wait(self.interval):
            if self._running() - self._contact > self.silence_limit:
                where = f"{self.spec.master_addr}:{self.spec.master_port}"
                self._give_up(
                    f"lost contact with the job's store at {where} for {self.silence_limit:g}s "
                    "(this host is cut off from the others, or the launcher's node is down)",
                    post=False,
                )

    def _tick(self) -> None:
        """Count the time this process did not run: a wait that ends over STALL late."""
        while not self._stop.wait(TICK):
            now = time.monotonic()
            if now - self._ticked > TICK + STALL:
                self._stopped_for += now - self._ticked - TICK  # before the tick moves: a reader counts it twice, never not at all
            self._ticked = now

    def _running(self) -> float:
        """Seconds on a clock that stands still while this process does not run; a stop the ticker has not
        counted yet (it may wake after the thread that asks) counts too."""
        now = time.monotonic()
        late = now - self._ticked - TICK
        return now - self._stopped_for - (late if late > STALL else 0.0)

    def _silent_peers(
        self, store: dist.TCPStore, heard: dict[int, tuple[int, float]], members: dict[int, dict], finished: set[int]
    ) -> list[str]:
        """The watched peers that are gone: a process that exited (seen at once: on this host by its
        pid, on another by its agent's notice); anywhere, one whose heartbeat stopped for ``silence_limit``
        of this process's running time."""
        now, silent = self._running(), []
        for r in ring.watched(store, self._namespace(), self.spec.rank, self.spec.world_size, finished):
            if r not in members:
                if not store.check([self._key("member", r)]):
                    continue  # not started yet
                members[r] = json.loads(store.get(self._key("member", r)))
            info = members[r]
            gone = not ring.pid_alive(info["pid"]) if info["host"] == self.host else store.check([self._key("died", r)])
            if gone:  # on another host, its agent says so
                if not store.check([self._key("done", r)]):  # else it finished and left since ``watched`` read it
                    silent.append(self._how_it_ended(store, r, info))
                continue
            beats = store.add(self._key("beat", r), 0)
            last = heard.get(r)
            if last is None or last[0] != beats:
                heard[r] = (beats, now)
            elif now - last[1] > self.silence_limit:
                silent.append(self._name_silent(store, r, info, self.silence_limit))
        return silent

    def _name_silent(self, store: dist.TCPStore, rank: int, member: dict, seconds: float) -> str:
        """``rank 1 (h, pid 5) stopped responding (...)``, recorded for the launcher too: when its agent
        has to kill that rank (a stopped process answers no SIGTERM), it says why (``launch.failures``)."""
        how = _silent_for(seconds)
        store.set(self._key("hung", rank), how)
        return f"{_where(rank, member)} {how}"

    def _how_it_ended(self, store: dist.TCPStore, rank: int, member: dict) -> str:
        """A peer whose process is gone: its own failure, the cause it stopped for, or a death."""
        if store.check([self._key("failed", rank)]):
            return f"{_where(rank, member)} failed: {store.get(self._key('failed', rank)).decode()}"
        if store.check([self._key("victim", rank)]):
            return store.get(self._key("victim", rank)).decode()  # it named the root cause
        if member["host"] != self.host:
            return f"{_where(rank, member)} died ({store.get(self._key('died', rank)).decode()})"
        return self._death(rank, member)

    def _death(self, rank: int, member: dict) -> str:
        """``rank 1 (h, pid 5) died``; where it was and why, when it ended in a collective (gloo's abort)."""
        from loom.comm.hangs import aborted
        from loom.comm.stacks import aborted_in, call_name

        try:
            with open(member["faults"]) as f:
                position = aborted_in(f.read())
        except (KeyError, OSError):
            position = None
        if position is None:
            return f"{_where(rank, member)} died"
        site, why = aborted(position)
        calls = self._record(failed_in_last=True)["calls"]  # its partner is gone: the newest waits for good (DDP's, placed at the user's line)
        mine = next((c for c in reversed(calls) if not c["done"]), calls[-1] if calls else None)
        here = f" while rank {self.spec.rank} is in {call_name(mine)}" if mine else ""
        return f"{_where(rank, member)} was aborted in {site}{here}: {why}"

    def _give_up(self, reason: str, post: bool = True) -> None:
        """The main thread may be stuck in a collective that will never finish: exit from here,
        and (``post``: the store is reachable) tell every rank why at once."""
        if post:
            self.post_failure(reason, victim=True)
            try:
                ring.raise_alarm(self._store, self._namespace(), self.spec.world_size, reason)
            except Exception:
                pass
        self._leave(f"loom: rank {self.spec.rank} on {self.host} cannot continue: {reason}", RankFailureError.EXIT_CODE)

    def _leave(self, line: str | None, code: int) -> NoReturn:
        """Say ``line`` and end the process, unless another thread already does: one last line per rank."""
        if self._leaving.acquire(blocking=False):
            if line is not None:
                _say(line)
            os._exit(code)
        threading.Event().wait()  # the other thread ends the process

    def post_failure(self, reason: str, victim: bool = False) -> None:
        """Tell the other ranks why this one is about to exit.

        A victim (stopping because another rank failed) is recorded apart, so that a rank
        diagnosing later still points at the root cause rather than at other victims.
        """
        try:
            self._store.set(self._key("victim" if victim else "failed", self.spec.rank), reason[:500])
        except Exception:
            pass

    def _member(self, rank: int) -> dict | None:
        key = self._key("member", rank)
        if not self._store.check([key]):
            return None
        return json.loads(self._store.get(key))

    def finished(self, rank: int) -> bool:
        """Whether ``rank`` ended its program (it left the job without failing)."""
        return self._store.check([self._key("done", rank)])

    def _beats(self, ranks: list[int]) -> dict[int, int]:
        return {r: self._store.add(self._key("beat", r), 0) for r in ranks}

    def diagnose(self, sample_heartbeats: bool = True) -> str | None:
        """Which other ranks failed, as one sentence; ``None`` when all look healthy.

        Local peers are checked by pid at once; remote ones by whether their heartbeat
        advanced over ``2.5 * interval`` (only when ``sample_heartbeats``).
        """
        try:
            return self._diagnose(sample_heartbeats)
        except Exception as exc:  # the store itself is gone: say so rather than guess
            return f"the job's store at {self.spec.master_addr}:{self.spec.master_port} is unreachable ({exc}); the launcher (or the node hosting it) is down"

    def _diagnose(self, sample_heartbeats: bool) -> str | None:
        others = [r for r in range(self.spec.world_size) if r != self.spec.rank]
        members = {r: self._member(r) for r in others}
        # Ranks that stopped because of another one are not the cause: look past them.
        suspects = {r: info for r, info in members.items() if info and not self._store.check([self._key("victim", r)])}

        found: list[str] = []
        for r, info in suspects.items():
            notice = self._key("failed", r)
            if self._store.check([notice]):
                found.append(f"{_where(r, info)} failed: {self._store.get(notice).decode()}")
            elif info["host"] == self.host and not ring.pid_alive(info["pid"]):
                found.append(self._death(r, info))
            elif self._store.check([self._key("died", r)]):  # its agent on another host saw it end
                found.append(f"{_where(r, info)} died ({self._store.get(self._key('died', r)).decode()})")
        if not found and sample_heartbeats:
            before = self._beats(list(suspects))
            time.sleep(2.5 * self.interval)
            after = self._beats(list(suspects))
            found = [self._name_silent(self._store, r, info, 2.5 * self.interval) for r, info in suspects.items() if after[r] == before[r]]
        never = [str(r) for r, info in members.items() if info is None]
        if not found and never:
            found.append(f"rank(s) {', '.join(never)} never joined the job")
        return "; ".join(found) or None

    def failure_error(self, cause: BaseException | None = None) -> LoomError | None:
        """A RankFailureError naming the failed peer, if ``cause`` came from one (without a cause:
        if any peer died or stopped responding, heartbeats sampled); for a collective that broke
        while every peer answers, a ``HangError`` saying where the ranks' collectives part."""
        sample = cause is None or looks_distributed(cause)
        reason = self.diagnose(sample_heartbeats=False)
        if reason is None and cause is not None and sample:
            hang = self._hang_error()
            if hang is not None:
                return hang
        if reason is None and sample:
            reason = self.diagnose(sample_heartbeats=True)
        if reason is None:
            return None
        self.post_failure(reason, victim=True)
        return RankFailureError(f"rank {self.spec.rank} on {self.host} cannot continue: {reason}")

    def _record(self, failed_in_last: bool = False, finished: bool = False) -> dict:
        from loom.comm import collective_log, stacks

        self._failed_in_last = failed_in_last = failed_in_last or self._failed_in_last  # it stays stuck there
        return collective_log.snapshot(self.spec.rank, self.host, stacks.main_frames(), failed_in_last, finished)

    def _publish_record(self, failed_in_last: bool = False, finished: bool = False) -> None:
        from loom.comm import collective_log

        collective_log.publish(self._store, self._namespace(), self._record(failed_in_last, finished), answers=1 << 30)

    def _answer_record_requests(self, store: dist.TCPStore, answered: int) -> int:
        from loom.comm import collective_log

        return collective_log.answer(store, self._namespace(), answered, self._record)

    def _hang_error(self) -> LoomError | None:
        """Compare every rank's collectives (the first rank here does; the others wait for its
        finding and stop because of it). None when a rank does not answer: then it is the
        heartbeats' case."""
        from loom.comm import collective_log
        from loom.comm.hangs import HangError, explain

        prefix, finding = self._namespace(), self._key("hang", 0)
        self._publish_record(failed_in_last=True)
        if self._store.add(self._key("hang-claim", 0), 1) == 1:
            asked = collective_log.request(self._store, prefix)
            records = collective_log.collect(self._store, prefix, self.spec.world_size, asked, wait=3 * self.interval)
            found = explain(records, self.spec.world_size) if len(records) == self.spec.world_size else None
            self._failing = self._failing or bool(found)  # before the others read the finding and exit
            self._store.set(finding, json.dumps({"rank": self.spec.rank, "found": found}))
            if found:  # a rank waiting in C++ hears it only through the alarm
                ring.raise_alarm(self._store, prefix, self.spec.world_size, _hung(self.spec.rank, found))
            return HangError(found) if found else None
        try:
            self._store.wait([finding], timedelta(seconds=5 * self.interval + 5))
            answer = json.loads(self._store.get(finding))
        except Exception:
            return None
        if not answer["found"]:
            return None
        reason = _hung(answer["rank"], answer["found"])
        self.post_failure(reason, victim=True)
        return RankFailureError(f"rank {self.spec.rank} on {self.host} cannot continue: {reason}")

    def _excepthook(self, exc_type, exc, tb) -> None:
        self._failing = True  # it leaves by itself, once it has said why
        if not isinstance(exc, LoomError) and looks_distributed(exc):
            error = self.failure_error(exc)  # name the dead peer, or where the collectives part
            if error is not None:
                try:
                    raise error from exc
                except LoomError as named:  # handled here, so the worker's hook records this one
                    return self._excepthook(type(named), named, named.__traceback__)
        if isinstance(exc, RankFailureError):  # a victim, not a cause: one line is the whole story
            self._leave(f"loom: {exc}", RankFailureError.EXIT_CODE)  # skip teardown: the group is broken and may hang
        self.post_failure("".join(traceback.format_exception_only(exc_type, exc)).strip())
        self._previous_excepthook(exc_type, exc, tb)
        self._reported = True
        if self._terminated:  # the agent asked while the error was being recorded: its teardown may wait on dead peers
            os._exit(1)

    def _on_sigterm(self, signum, frame) -> None:
        # The agent terminates the survivors once one worker has failed: say which one.
        if self._failing:  # this rank is saying why it fails: once its error is recorded, nothing is lost by leaving
            if self._reported:
                os._exit(1)
            self._terminated = True
            return
        reason = self.diagnose(sample_heartbeats=False)
        if not reason and preemption.armed():
            preemption.request()  # a preemption notice: save at the next step boundary
            return
        if reason:
            self.post_failure(reason, victim=True)
        why = f"cannot continue: {reason}" if reason else "terminated by SIGTERM"
        self._leave(f"loom: rank {self.spec.rank} on {self.host} {why}", RankFailureError.EXIT_CODE if reason else 128 + signal.SIGTERM)


def _where(rank: int, member: dict) -> str:
    return f"rank {rank} ({member['host']}, pid {member['pid']})"


def _hung(rank: int, found: str) -> str:
    return f"rank {rank} found the job hung: {found}"


def _silent_for(seconds: float) -> str:
    return f"stopped responding (no heartbeat for {seconds:g}s)"


def resolve_silence_limit() -> float:
    """Seconds without a peer's heartbeat before it counts as gone (``LOOM_HEARTBEAT_TIMEOUT``, default 30)."""
    return seconds_from_env("LOOM_HEARTBEAT_TIMEOUT", 30.0)


def resolve_hang_check() -> float:
    """Seconds the main thread stands still before the ranks' records are compared (``LOOM_HANG_CHECK``, default 15)."""
    return seconds_from_env("LOOM_HANG_CHECK", 15.0)


def _traceback_of(frame: types.FrameType | None) -> types.TracebackType | None:
    """A traceback through ``frame`` and its callers, as if an exception were raised there."""
    tb = None
    while frame is not None:
        tb = types.TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
        frame = frame.f_back
    return tb


def _say(line: str) -> None:
    """One write per line: the ranks share a terminal, and split writes interleave."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def looks_distributed(exc: BaseException) -> bool:
    """Whether an exception came from the communication layer rather than the user's code."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(s in text for s in ("gloo", "Gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out"))
