"""The trainer's side of its worker processes: start them, hand out and take back their slots, stop them.

``num_workers`` processes share one shared-memory file of batch slots (slots.py), ``slots``
per worker, and exchange slot numbers with the trainer through rings in the same file
(protocol.py): in steady state a batch costs the trainer no system call.

The trainer's side of a slot, for every feed (``WorkerFeed``, ``WorkerDeviceFeed``):

- ``hand_out(w)``: worker ``w``'s next batch, the slot held, in one call a batch (``WorkerFeed``);
  ``take(w)``: worker ``w``'s next filled batch slot (``receive(w)``: waiting for it);
- ``fields(w, slot)``: the slot's field arrays (made once per slot), ``bases[w][slot]`` its bytes,
  ``batches.slots[w][slot]`` the slot's tensors and keys, made once, handed out as a new dict (slots.SlotState);
- ``hold(w, slot, event=None)``: the slot is in use: it goes back to its worker once nothing
  refers to it any more (every numpy view refers to its arrays, every view of its tensors to
  their storage: reference and use counts tell, slots.SlotBatches) or, given a CUDA ``event``, once that event has
  completed; when page-locked, also once the CUDA work queued before that point has finished;
- ``release(w, slot)``: the slot is free (a slot not held); ``recycle()``: free every held slot
  nothing refers to any more. ``WorkerFeed`` takes every batch at hand in one go and recycles once
  per go, sending the freed slots at once (``recycle(send=True)``), so a worker that sleeps for want
  of a slot is woken once per go, not per batch; otherwise freed slots go back a full RELEASE
  record (PER_RELEASE) at a time, and at once when the trainer waits on their worker;
  ``flush(w)`` sends them now.

A dead worker is named within POLL_S of the trainer waiting on it; one that stops answering
(stopped by SIGSTOP, or hung so that not even its watchdog thread runs: its heartbeat in
shared memory stands still) within SILENT_S; one alive that sends no batch (a transform that
hangs) is warned about with its stack, and past the loader's ``timeout`` raised (watch.py).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import time
from typing import Any

import numpy as np
import torch

from streamwin.errors import WorkerError
from streamwin.feed.stopping import check as check_interrupt
from streamwin.feed.protocol import (BATCH, ERROR, PER_RELEASE, RELEASE, RUN, STOP, WARNING, Channel, has_payload,
                                     raise_warning, rebuild_error, ring_size)
from streamwin.feed.sizing import chunk_of, pool_slots, shared_batches
from streamwin.feed.slots import SharedFile, SlotBatches, SlotLayout
from streamwin.feed.stats import STAT_FIELDS
from streamwin.feed.watch import WorkerWatch
from streamwin.feed.worker import worker_main
from streamwin.transform import TIMEOUT_S

POLL_S = 0.05  # how often a waiting trainer checks that its workers live
NO_SLOTS = (-1,) * PER_RELEASE  # a RELEASE record's places past its slots
SILENT_S = 10.0  # a worker whose heartbeat stands still this long while the trainer waits on it is named


class WorkerPool:
    """``num_workers`` processes, each with ``slots`` batch slots in one shared file (trainer side).

    ``slots``: per worker, the batches it may have ready plus those the training loop may hold
    (the spare slots are added: sizing.spare_slots).
    """

    def __init__(self, ds, num_workers: int, world: tuple[int, int], *, slots: int, pin: bool, context,
                 start_timeout: float = 120.0, timeout: float | None = TIMEOUT_S):
        self.num_workers = num_workers
        # everything close() reads, first: a Ctrl-C or an error at any point of the start leaves a pool close() stops
        self.closed = False
        self.watch = WorkerWatch(timeout)  # processes, counters, stacks: who is dead, silent or stuck (watch.py)
        self.procs = self.watch.procs
        self.conns: list = []
        self.inbox: list[Channel] = []  # per worker: its records to the trainer
        self.outbox: list[Channel] = []  # per worker: the trainer's records to it
        self.bases: list = []
        self.regions: list = []
        self.batches = SlotBatches([])
        self.run = 0
        self.held: list[list] = []  # [worker, slot, cuda event or None, SlotState]: slots handed out, not yet released
        self.pending: list[list[int]] = [[] for _ in range(num_workers)]  # released, not yet sent
        self._holding = [0] * num_workers  # held slots per worker
        self.waits = 0  # times the trainer waited for a worker's record (each sends the releases pending first)
        self.fallbacks = 0  # waits for a worker that outlasted POLL_S (each one a liveness check)
        self._alive = [functools.partial(self.watch.check_alive, w) for w in range(num_workers)]  # raise if w died
        # shared batches: each worker's slot of the batch being taken; the worker whose part was last waited for
        self._parts, self._last = [None] * num_workers, 0
        try:
            self._start(ds, num_workers, world, slots, pin, context, start_timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, ds, num_workers: int, world: tuple[int, int], slots: int, pin: bool, context,
               start_timeout: float) -> None:
        """Map the slots, start the workers (SIGINT blocked while each forks: it starts ignoring it), wait for each
        to be READY (a Ctrl-C meanwhile, held by the loader, is raised here: stopping.py)."""
        layout = ds.layout()
        n = pool_slots(slots, layout.nbytes, num_workers, chunk_of(ds, num_workers, world[1]))
        # shared batches: every worker writes its rows of each batch into the same slot, of all the workers' slots
        self.shared = shared_batches(ds, num_workers, world[1])
        owners, n = (1, n * num_workers) if self.shared else (num_workers, n)
        # slots of a worker the training loop may hold (handed out, or ready to be) before batches are copied out:
        # the worker keeps two
        self.keep_limit = n - 2
        self.slot_layout = SlotLayout(num_workers, n, layout.nbytes, ring_size(n), shared=self.shared)
        self.shm = SharedFile(self.slot_layout.nbytes)
        self.pinned = pin and self.shm.pin()
        self.events = self.pinned and torch.cuda.is_available()  # held slots wait for queued copies
        arr = self.shm.array()
        # per slot: a Region (its own array, which every view of the slot refers to), its fields made once
        self.regions = [[self.slot_layout.region(self.shm, w, i) for i in range(n)] for w in range(owners)]
        self.bases = [[r.array() for r in rs] for rs in self.regions]
        self.batches = SlotBatches(self.bases, layout, ds.manifests)
        self.watch.counters = [self.slot_layout.counters(arr, w) for w in range(num_workers)]
        self.watch.stacks = [self.slot_layout.stack(arr, w) for w in range(num_workers)]
        for w in range(num_workers):
            mine, theirs = context.Pipe(duplex=True)
            self.conns.append(mine)
            sems = [context.Semaphore(v) for v in (0, self.slot_layout.ring, 0, self.slot_layout.ring)]
            to_worker, to_trainer = self.slot_layout.rings(arr, w)
            self.outbox.append(Channel(to_worker, sems[0], sems[1], mine))
            self.inbox.append(Channel(to_trainer, sems[2], sems[3], mine))
            p = context.Process(target=worker_main, name=f"streamwin-worker-{w}", daemon=True,
                                args=(ds, num_workers, w, world, self.shm.handle(), self.slot_layout, theirs,
                                      tuple(sems), os.getpid()))
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                p.start()
                self.procs.append(p)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
        deadline = time.monotonic() + start_timeout
        for w in range(num_workers):
            while self._next(w, POLL_S) is None:  # its READY
                check_interrupt()
                self.watch.check_alive(w)
                if time.monotonic() > deadline:
                    raise WorkerError(f"streamwin worker {w} did not start within {start_timeout:.0f} s")

    def start(self, epoch: int, first_batches: list[int], rest_of: list[dict[str, Any]] = (),
              shared: bool = False) -> None:
        """Begin a pass: worker w yields its stream's batches from ``first_batches[w]`` on.

        ``rest_of``: the epoch's interrupted runs after an elastic resume (the plan is the rest of the epoch).
        ``shared``: the plan's, as the pool's (each worker writes its rows of every batch into one slot). Each
        worker is told the slots free (those it writes that nothing holds, in order): with shared batches every
        worker then takes the same slot for the same batch, and a batch of the pass before is not given back.
        """
        if shared != self.shared:
            raise RuntimeError(f"a pass with shared={shared} on workers with shared={self.shared} (a bug)")
        self.run, self._parts = self.run + 1, [None] * self.num_workers
        self.pending = [[] for _ in range(self.num_workers)]  # in the lists below
        held = {(h[0], h[1]) for h in self.held}
        for w in range(self.num_workers):
            free = [i for i in range(self.slot_layout.slots) if (0 if shared else w, i) not in held]
            tail = json.dumps({"rest": list(rest_of), "free": free}).encode()
            self._send(w, RUN, self.run, epoch, first_batches[w], payload=tail)

    def take(self, w: int) -> int:
        """The slot of worker ``w``'s next batch of this pass (shared: all parts in; slots recycled meanwhile)."""
        if self.shared:
            return self._shared_slot(True)
        msg = self.inbox[w].receive()
        if msg is not None and msg[0] == BATCH and msg[1] == self.run:  # the usual case: it is there already
            return msg[2]
        return self.receive(w, first=self._read(w, msg))

    def hand_out(self, w: int, wait: bool = True) -> tuple[int, dict | None, bool] | None:
        """(slot, batch, held) of worker ``w``'s next batch: a new dict of the slot's tensors, made once, the
        slot held; batch None for packed rows (their per-crop fields are cut per batch; the slot is held), or,
        ``keep_limit`` slots of ``w``'s still held by the training loop, not held (copy it, then release it).
        Not ``wait``: None unless a record is there already and the slot can be held (a record other than this
        pass's batch, a warning or an abandoned pass's batch, is dealt with, then the batch after it waited for).

        Held slots are recycled by the caller (``WorkerFeed._fill``: once for all the batches at hand).
        """
        if not wait and self._holding[w] >= self.keep_limit:
            return None
        if self.shared:
            slot = self._shared_slot(wait)
            if slot is None:
                return None
        elif (msg := self.inbox[w].receive()) is not None and msg[0] == BATCH and msg[1] == self.run:
            slot = msg[2]  # take(w) and, below, hold(w, slot), inlined: each call costs after a step
        elif msg is None and not wait:
            return None
        else:
            slot = self.receive(w, first=self._read(w, msg))
        if self._holding[w] >= self.keep_limit:  # batches are being kept: the held ones may be free by now
            self.recycle(send=True)
            if self._holding[w] >= self.keep_limit:  # the worker would run out of slots
                return slot, None, False
        state = self.batches.slots[w][slot]
        self.held.append([w, slot, None, state])
        self._holding[w] += 1
        return slot, state.made.copy() if self.batches.ahead else None, True

    def _shared_slot(self, wait: bool) -> int | None:
        """Shared batches: the next batch's slot once every worker's part is in (not ``wait``: None while one is
        missing, the parts in kept). It waits first for the worker it last waited for (most often the last: one
        wake-up a batch, not a part). Parts in different slots are a WorkerError, never a batch of mixed parts."""
        parts = self._parts
        for w, part in enumerate(parts):
            if part is None and (msg := self.inbox[w].receive()) is not None:
                parts[w] = msg[2] if msg[0] == BATCH and msg[1] == self.run else self.receive(w, self._read(w, msg))
        missing = [w for w, part in enumerate(parts) if part is None]
        if missing and not wait:
            return None
        for w in sorted(missing, key=lambda v: v != self._last):
            waits = self.waits
            parts[w] = self.receive(w)
            if self.waits > waits:
                self._last = w
        slot = parts[0]
        self._parts = [None] * self.num_workers
        if any(p != slot for p in parts):
            raise WorkerError(f"streamwin workers wrote their parts of one batch into different slots {parts}: the "
                              "shared-batch hand-off lost its order (a bug: please report it)")
        return slot

    def fields(self, w: int, slot: int) -> dict[str, np.ndarray]:
        """The field arrays of slot ``slot`` of worker ``w`` (made once; each refers to the slot)."""
        return self.batches.slots[w][slot].fields

    def receive(self, w: int, first: tuple | None = None) -> int:
        """The slot of worker ``w``'s next BATCH of the current pass, waiting for it (held slots are recycled
        meanwhile); a BATCH of an abandoned pass is released. ``first``: a record of ``w``'s already read."""
        while True:
            msg, first = first or self._next(w), None
            if msg is None:
                self.waits += 1
                self.recycle()
                self.flush(w)  # the worker may be waiting for these
                wait = self.watch.wait(w)
                while (msg := self._next(w, POLL_S)) is None:
                    self.fallbacks += 1
                    wait.poll(SILENT_S)  # raises if w died, stands still, or sends nothing for the timeout
                    self.recycle()
                    self.flush(w)
            kind, run, slot = msg[:3]
            if kind == BATCH and run == self.run:
                return slot  # (a batch of a pass abandoned midway: its slot is among the free ones the worker was told)

    def _next(self, w: int, timeout: float = 0.0) -> tuple[int, ...] | None:
        """Worker ``w``'s next record within ``timeout`` s, or None; an error of this pass is raised, a warning warned."""
        return self._read(w, self.inbox[w].receive(timeout))

    def _read(self, w: int, msg: tuple | None) -> tuple[int, ...] | None:
        """A record of worker ``w``'s, its payload read: an error of this pass is raised, a warning warned."""
        if msg is None or not has_payload(msg):
            return msg
        try:
            payload = json.loads(self.inbox[w].payload())
        except (EOFError, OSError):
            self.watch.check_alive(w, wait=1.0)
            raise WorkerError(f"streamwin worker {w} (pid {self.procs[w].pid}) closed its pipe")
        if msg[0] == WARNING:
            raise_warning(payload, w)
            return WARNING, self.run, -1, 0, 0
        if payload["run"] == self.run:
            raise rebuild_error(payload) from WorkerError(
                f"in streamwin worker {w} (pid {self.procs[w].pid}):\n{payload['text']}")
        return ERROR, payload["run"], -1, 0, 0

    # -- slots the training loop holds -------------------------------------------------------------
    def hold(self, w: int, slot: int, event=None) -> None:
        """Slot ``slot`` of worker ``w`` is in use (by the training loop, or by a queued copy: ``event``)."""
        self.held.append([w, slot, event, self.batches.slots[w][slot]])
        self._holding[w] += 1

    def recycle(self, send: bool = False) -> None:
        """Give back every held slot no one refers to any more (and whose queued CUDA copies are done);
        ``send``: tell their workers now instead of a full RELEASE record at a time."""
        if not self.held:
            return
        keep, in_use = [], self.batches.in_use
        for h in self.held:
            w, slot, event, state = h
            if event is None:
                if in_use(state):  # a view or a tensor of it lives
                    keep.append(h)
                    continue
                if self.events:  # a non_blocking copy from this slot may still be queued: wait for it
                    h[2] = event = torch.cuda.Event()
                    event.record()
            if event is not None and not event.query():
                keep.append(h)
                continue
            self._holding[w] -= 1
            self.pending[w].append(slot)
        self.held = keep
        for w, pending in enumerate(self.pending):
            if pending and (send or len(pending) >= PER_RELEASE):
                self.flush(w)

    def release(self, w: int, slot: int) -> None:
        """Give slot ``slot`` back to worker ``w`` (sent with the next PER_RELEASE - 1, or when waiting on ``w``)."""
        pending = self.pending[w]
        pending.append(slot)
        if len(pending) >= PER_RELEASE:
            self.flush(w)

    def flush(self, w: int) -> None:
        """Send worker ``w`` the slots released since the last RELEASE (with shared batches, every worker)."""
        to = range(self.num_workers) if self.shared else (w,)
        pending = self.pending[0 if self.shared else w]
        while pending:
            slots = pending[:PER_RELEASE]
            del pending[:PER_RELEASE]
            for v in to:
                self._send(v, RELEASE, *slots, *NO_SLOTS[len(slots):])

    def _send(self, w: int, tag: int, *args: int, payload: bytes = b"") -> None:
        """A record to worker ``w`` (a dead worker is reported by take())."""
        try:
            self.outbox[w].send(tag, *args, payload=payload, waiting=self._alive[w])
        except (BrokenPipeError, OSError):
            pass  # a dead worker is reported by take()

    def stats(self) -> np.ndarray:
        """The workers' read counters, summed (run totals)."""
        counters = self.watch.counters
        return np.sum([c[: len(STAT_FIELDS)] for c in counters], axis=0, dtype=np.int64) if counters else \
            np.zeros(len(STAT_FIELDS), dtype=np.int64)

    def close(self) -> None:
        """Stop the workers (politely, then by force) and give up the shared memory."""
        if self.closed:
            return
        self.closed = True
        for channel in self.outbox:
            try:
                channel.send(STOP, wait=False)  # a worker that reads nothing any more is terminated below
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for w, p in enumerate(self.procs):
            if w in self.watch.silent:  # stopped or hung: it would not stop by itself (SIGKILL ends even a stopped one)
                p.kill()
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.terminate()
                p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.bases = self.regions = []
        self.batches = SlotBatches([])
        self.inbox, self.outbox = [], []
        self.watch.close()  # keep the totals readable, let the mapping go

