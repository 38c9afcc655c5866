"""What a worker the trainer waits on is doing: dead, silent, or alive and sending no batch (and where it is).

Each worker's watchdog thread (worker.py) bumps a heartbeat counter in shared memory every
HEARTBEAT_S and, when the trainer asks (``ASKED`` moves past ``GIVEN``), writes its main
thread's Python stack into the worker's stack area of the shared file (slots.SlotLayout) and
answers (``GIVEN``). While the trainer waits on a worker (``WorkerWatch.wait``), each poll
raises if it died, or if its heartbeat stood still for ``silent_s`` (stopped by SIGSTOP, or
hung holding the GIL: then it cannot say where); past ``warn_after(timeout)`` s with no batch
it warns once with the worker's stack (a transform that hangs, a read that stalls), and past
``timeout`` s raises a WorkerError with it. Only the time this process runs counts: a trainer
that was itself stopped does not blame its workers for it.
"""
from __future__ import annotations

import signal
import sys
import time
import traceback
import warnings

import numpy as np

from streamwin.errors import WorkerError
from streamwin.transform import warn_after

HEARTBEAT = 15  # the worker's counter (feed.slots.COUNTERS per worker) that its watchdog thread bumps
HEARTBEAT_S = 0.25  # how often
ASKED, GIVEN = 13, 14  # counters: the trainer's requests for the worker's stack, the last one its watchdog answered
ANSWER_S = 2.0  # how long the trainer waits for a stack (the watchdog answers within HEARTBEAT_S)
PAUSED_S = 1.0  # a gap this long between two looks: this process was not running meanwhile (not counted)


def answer_stack(counters: np.ndarray, area: np.ndarray, thread: int) -> None:
    """Worker side (its watchdog): if the trainer asked, write thread ``thread``'s stack into ``area`` and answer."""
    asked = int(counters[ASKED])
    if asked == int(counters[GIVEN]):
        return
    frame = sys._current_frames().get(thread)
    text = "".join(traceback.format_stack(frame)) if frame is not None else "(its main thread has ended)\n"
    data = text.encode("utf-8", "replace")[-(len(area) - 8):]  # the innermost calls, if it is long
    area[8 : 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    area[:8].view(np.int64)[0] = len(data)
    counters[GIVEN] = asked


class WorkerWatch:
    """The trainer's watch over its workers: their processes, counters and stack areas (shared memory)."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.procs: list = []
        self.counters: list[np.ndarray] = []
        self.stacks: list[np.ndarray] = []
        self.silent: set[int] = set()  # workers named for not answering or timing out: close() kills them at once

    def check_alive(self, w: int, wait: float = 0.0) -> None:
        """WorkerError naming worker ``w`` if its process has ended (``wait``: s to wait for it to end first)."""
        p = self.procs[w]
        p.join(wait) if wait else None
        code = p.exitcode
        if code is not None:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
            hint = " (out of memory?)" if code == -signal.SIGKILL else ""
            raise WorkerError(f"streamwin worker {w} (pid {p.pid}) {how}{hint}")

    def wait(self, w: int) -> "Wait":
        """The trainer begins to wait for worker ``w``'s next record."""
        return Wait(self, w)

    def stack(self, w: int) -> str:
        """Worker ``w``'s main thread's Python stack now, asked of its watchdog (or why there is none)."""
        counters, area = self.counters[w], self.stacks[w]
        counters[ASKED] += 1
        asked, deadline = int(counters[ASKED]), time.monotonic() + ANSWER_S
        while int(counters[GIVEN]) != asked:
            if time.monotonic() > deadline:
                return f"(its watchdog did not answer within {ANSWER_S:g} s: it is {process_state(self.procs[w].pid)})\n"
            time.sleep(0.01)
        n = int(area[:8].view(np.int64)[0])
        return bytes(area[8 : 8 + n]).decode("utf-8", "replace")

    def close(self) -> None:
        """Keep the counters' totals readable; let the shared memory go."""
        self.counters = [c.copy() for c in self.counters]
        self.stacks = []


class Wait:
    """One wait of the trainer for one worker's record, polled every POLL_S (``poll``)."""

    def __init__(self, watch: WorkerWatch, w: int):
        now = time.monotonic()
        self.watch, self.w = watch, w
        self.waited, self.looked, self.warned = 0.0, now, False
        beat = int(watch.counters[w][HEARTBEAT])
        self.beat, self.still = beat, 0.0  # the heartbeat last seen, and for how long it has stood still

    def poll(self, silent_s: float) -> None:
        """A WorkerError if the worker died, its heartbeat stood still ``silent_s`` s, or it sent nothing for
        ``timeout`` s; a warning (once) past ``warn_after(timeout)`` s, saying where it is."""
        watch, w = self.watch, self.w
        watch.check_alive(w)
        now = time.monotonic()
        step, self.looked = now - self.looked, now
        if step > PAUSED_S:  # this process itself was not running (stopped too): not the worker's time
            step = 0.0
        self.waited += step
        beat = int(watch.counters[w][HEARTBEAT])
        self.still, self.beat = (0.0 if beat != self.beat else self.still + step), beat
        p = watch.procs[w]
        if self.still > silent_s:
            watch.silent.add(w)
            raise WorkerError(f"streamwin worker {w} (pid {p.pid}) has not answered for {self.still:.0f} s: it is "
                              f"{process_state(p.pid)}; it is killed when the loader closes")
        timeout = watch.timeout
        if timeout is not None and self.waited > timeout:
            watch.silent.add(w)
            raise WorkerError(f"streamwin worker {w} (pid {p.pid}) sent no batch for {self.waited:.0f} s "
                              f"(WindowLoader(timeout={timeout:g})); it is alive, its main thread at:\n"
                              f"{watch.stack(w)}it is killed when the loader closes")
        if not self.warned and self.waited > warn_after(timeout):
            self.warned = True
            limit = "it waits for ever (timeout=None)" if timeout is None else f"raises at timeout={timeout:g} s"
            warnings.warn(f"streamwin: worker {w} (pid {p.pid}) has sent no batch for {self.waited:.0f} s; it is "
                          f"alive, its main thread at:\n{watch.stack(w)}(the loader {limit})", RuntimeWarning,
                          stacklevel=2)


def process_state(pid: int) -> str:
    """How a process is, from /proc (Linux): stopped (SIGSTOP?), running, sleeping...; else "not answering"."""
    names = {"T": "stopped (SIGSTOP or SIGTSTP: `kill -CONT` resumes it)", "t": "stopped by a debugger",
             "R": "running (hung in a loop?)", "S": "sleeping (hung in a wait?)", "D": "in uninterruptible I/O",
             "Z": "a zombie"}
    try:
        with open(f"/proc/{pid}/stat") as f:
            return names.get(f.read().rsplit(")", 1)[1].split()[0], "not answering")
    except (OSError, IndexError):
        return "not answering"

