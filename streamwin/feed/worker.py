"""A worker process: it runs one stream of the plan per pass and gathers batches into shared-memory slots.

The trainer and the worker exchange records through two rings in shared memory (protocol.py).
A worker writes a batch only into a slot the trainer has released, so a batch the trainer
still holds is never overwritten; per batch it sends the slot's number (device mode too: the
trainer copies the slot to the device). A worker ignores SIGINT (the trainer
stops it) and exits when the trainer dies: a thread of its own (``watch_parent``) checks every
HEARTBEAT_S that the trainer lives and exits the process at once when it does not, even while
the worker is blocked in a read; the same thread bumps a heartbeat counter in shared memory,
by which the trainer tells a worker that stopped answering (SIGSTOP, a hung interpreter).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from streamwin.dataset import WindowDataset
from streamwin.feed.protocol import (BATCH, PER_RELEASE, READY, RELEASE, RUN, STOP, Channel, forward_warnings,
                                     send_error)
from streamwin.feed.slots import SharedFile, SharedHandle, SlotLayout
from streamwin.feed.stats import STAT_FIELDS, read_counters
from streamwin.feed.watch import HEARTBEAT, HEARTBEAT_S, answer_stack
from streamwin.pipeline import open_stream




class Interrupted(Exception):
    """A command arrived while a pass was running."""

    def __init__(self, msg: tuple):
        self.msg = msg


class ParentGone(Exception):
    """The trainer process died."""


def parent_gone(parent_pid: int, ppid: int) -> bool:
    """Whether the trainer ``parent_pid`` is gone: this process was given another parent (fork: the trainer
    died; forkserver: its server, which exits with the trainer), or no process has that pid any more."""
    if os.getppid() != ppid:
        return True
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a process of that pid exists (another user's, after pid reuse: a rare miss)
        pass
    return False


def watch_parent(parent_pid: int, counters: np.ndarray, stack: np.ndarray) -> None:
    """Start the worker's watchdog thread: every HEARTBEAT_S it bumps its heartbeat counter, writes the main
    thread's stack into ``stack`` when the trainer asks (watch.py), and, once the trainer is gone, exits this
    process at once (a read blocked on a stalled server would otherwise outlive it)."""
    ppid, main = os.getppid(), threading.main_thread().ident

    def run() -> None:
        while True:
            counters[HEARTBEAT] += 1
            if parent_gone(parent_pid, ppid):
                os._exit(0)  # nothing of ours to clean: shared memory has no name; a cache temp file is swept
            answer_stack(counters, stack, main)
            time.sleep(HEARTBEAT_S)
    threading.Thread(target=run, name="streamwin-watchdog", daemon=True).start()


class Inbox:
    """What the trainer sends a worker: released slots and commands (RUN, STOP)."""

    def __init__(self, channel: Channel, parent_pid: int):
        self.channel, self.parent_pid, self.ppid = channel, parent_pid, os.getppid()

    def check_parent(self) -> None:
        """ParentGone if the trainer died."""
        if parent_gone(self.parent_pid, self.ppid):
            raise ParentGone

    def next(self, wait: bool = True) -> tuple | None:
        """The next message: (RELEASE, slots...), (RUN, run, epoch, first, {"rest": interrupted runs, "free": free
        slots}) or (STOP,); None (``wait=False``) if none has arrived. Raises ParentGone if the trainer died meanwhile."""
        while (msg := self.channel.receive(1.0 if wait else 0.0)) is None:
            if not wait:
                return None
            self.check_parent()
        if msg[0] != RUN:
            return msg
        try:
            tail = json.loads(self.channel.payload())
        except (EOFError, OSError) as e:  # the trainer's end of the pipe is closed
            raise ParentGone from e
        return RUN, msg[1], msg[2], msg[3], tail


def worker_main(ds: WindowDataset, num_workers: int, worker: int, world: tuple[int, int], shared: SharedHandle,
                slot_layout: SlotLayout, conn, semaphores: tuple, parent_pid: int) -> None:
    """A worker process: map the slots, then run the passes the trainer asks for.

    ``semaphores``: (items, space) of the channel to the worker, then of the one to the trainer.
    """
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with SIGINT blocked (pool.py): a Ctrl-C is the trainer's
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    torch.set_num_threads(1)
    arr = SharedFile(slot_layout.nbytes, shared).array()
    to_worker, to_trainer = slot_layout.rings(arr, worker)
    inbox = Inbox(Channel(to_worker, *semaphores[:2], conn), parent_pid)
    outbox = Channel(to_trainer, *semaphores[2:], conn)
    forward_warnings(outbox)
    layout = ds.layout()
    slots = Slots([layout.views(slot_layout.slot(arr, worker, i)) for i in range(slot_layout.slots)], inbox, outbox)
    counters = slot_layout.counters(arr, worker)
    watch_parent(parent_pid, counters, slot_layout.stack(arr, worker))
    outbox.send(READY, worker)
    totals = np.zeros(len(STAT_FIELDS), dtype=np.int64)
    plans: dict[str, Any] = {}
    stream = world[0] * max(1, num_workers) + worker
    cmd = None
    try:
        while True:
            msg = cmd or inbox.next()
            cmd = None
            if msg[0] == STOP:
                return
            if msg[0] == RELEASE:
                slots.freed(msg)
                continue
            _, run, epoch, first, tail = msg
            key = json.dumps([epoch, tail["rest"]])
            if key not in plans:
                plans.clear()  # the trainer's world: torch.distributed is not initialized here
                plans[key] = ds.plan(epoch, num_workers, tail["rest"], world_size=world[1])
            slots.begin(tail["free"], plans[key].rows(stream) if slot_layout.shared else None)
            cmd = run_pass(ds, plans[key], stream, run, first, slots, counters, totals)
    except ParentGone:
        return


class Slots:
    """A worker's view of the slots it writes (``views``: each one's field views; shared batches: all the workers'
    slots, of which it writes its rows): which are free, waiting for the trainer to release one."""

    def __init__(self, views: list[dict], inbox: Inbox, outbox: Channel):
        self.views, self.inbox, self.outbox = views, inbox, outbox
        self.slots = views
        self.free = deque(range(len(self.slots)))
        self.taken: list[int] = []  # popped for output that has not gone out yet

    def begin(self, free: list[int], rows: tuple[int, int] | None) -> None:
        """A pass begins: ``free``, the slots the trainer holds none of (in the order to take them: with shared
        batches every worker takes the same slot for the same batch); ``rows``: shared batches, the rows of each
        slot this worker writes (else None: whole slots)."""
        self.free, self.taken = deque(free), []
        lo, hi = rows or (0, None)
        self.slots = self.views if rows is None else [{k: v[lo:hi] for k, v in s.items()} for s in self.views]

    def freed(self, msg: tuple) -> None:
        """The slots of a RELEASE record are free again."""
        self.free.extend(s for s in msg[1 : 1 + PER_RELEASE] if s >= 0)

    def take(self):
        """A free slot's field views; its number is ``taken[-1]``."""
        while not self.free:
            msg = self.inbox.next()
            if msg[0] != RELEASE:
                raise Interrupted(msg)
            self.freed(msg)
        self.taken.append(self.free.popleft())
        return self.slots[self.taken[-1]]

    def sent(self, run: int) -> None:
        """Send the slot taken first (BATCH), then collect the releases (or a command) that have arrived.
        While the ring to the trainer is full, it waits as long as the trainer lives."""
        self.outbox.send(BATCH, run, self.taken.pop(0), waiting=self.inbox.check_parent)
        while (msg := self.inbox.next(wait=False)) is not None:
            if msg[0] != RELEASE:
                raise Interrupted(msg)
            self.freed(msg)

    def give_back(self) -> None:
        """Slots popped for output that never went out are free again."""
        self.free.extend(self.taken)
        self.taken.clear()


def run_pass(ds: WindowDataset, plan, stream: int, run: int, first: int, slots: Slots, counters: np.ndarray,
             totals: np.ndarray) -> tuple | None:
    """One pass of a stream into free slots; returns a command that interrupted it, or None."""
    running = None
    try:
        running = open_stream(ds, plan, stream, first, slots.take, prefetch=False)
        for _ in running:
            counters[: len(STAT_FIELDS)] = totals + read_counters(running.stats())
            slots.sent(run)
        return None
    except Interrupted as e:
        return e.msg
    except (ParentGone, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # hand the error to the trainer, which raises it
        send_error(slots.outbox, run, e)
        return None
    finally:
        slots.give_back()
        if running is not None:
            stats = running.stats()
            running.shutdown()
            totals += read_counters(stats)
            counters[: len(STAT_FIELDS)] = totals

