"""Worker processes that gather batches into shared-memory slots; the trainer receives slot numbers.

Each worker runs one stream of the plan per pass. The trainer and a worker talk over one
pipe, in fixed 33-byte messages (no pickling per batch):

    trainer -> worker   RUN(run, epoch, first batch)[+ JSON] | RELEASE(slot) | STOP
    worker -> trainer   READY | BATCH(run, slot)      | an error, as JSON (rare)
    device mode         BLOCK(run, bytes, windows, source), then CHUNK(run, slot, bytes) ...

In device mode a worker ships whole blocks instead of batches, every source's of a mixed
stream, in the order its batcher will read them (``nodes.block_order``): the trainer files
each under its source and never waits for a block queued behind ones it needs later.

A worker writes a batch only into a slot the trainer has released, so a batch the trainer
still hands out is never overwritten. ``run`` numbers passes: after a pass is abandoned
midway (persistent workers), the trainer discards and releases what the old pass still
sends. After an elastic resume, RUN carries the epoch's interrupted runs as a JSON tail
(once per pass, a few hundred bytes), from which the worker plans the rest of the epoch.
A worker ignores SIGINT (the trainer stops it) and exits when the trainer dies.
"""
from __future__ import annotations

import builtins
import json
import os
import signal
import struct
import threading
import time
import traceback
import warnings
from collections import deque
from typing import Any, Callable

import numpy as np

from streamwin.dataset import close_stream, open_blocks, open_stream
from streamwin.feed.device import window_table
from streamwin import errors
from streamwin.errors import ShardError, WorkerError
from streamwin.feed.slots import SharedFile, SharedHandle, SlotLayout

_MSG = struct.Struct("<Bqqqq")
READY, BATCH, RUN, RELEASE, STOP, ERROR, WARNING, BLOCK, CHUNK = 1, 2, 3, 4, 5, 0, 6, 7, 8
CHUNK_BYTES = 4 << 20  # slot size when workers ship blocks
_SEND = threading.Lock()  # the read-ahead thread may send a warning while the main thread sends a batch
STAT_FIELDS = ("bytes_read", "reads", "retries", "skipped_ranges", "skipped_windows", "cache_hits", "bytes_decompressed")
POLL_S = 0.05  # how often a waiting trainer checks that its workers live


class _Interrupted(Exception):
    """A command arrived while a pass was running."""

    def __init__(self, msg: tuple):
        self.msg = msg


class _ParentGone(Exception):
    """The trainer process died."""


def _send(conn, tag: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> None:
    with _SEND:
        conn.send_bytes(_MSG.pack(tag, a, b, c, d))


def _forward_warnings(conn) -> None:
    """Warnings raised in a worker (on any of its threads) are raised again in the trainer."""
    def show(message, category, filename, lineno, file=None, line=None):
        payload = json.dumps({"category": category.__name__, "message": str(message)}).encode()
        with _SEND:
            conn.send_bytes(bytes([WARNING]) + payload)
    warnings.showwarning = show


def _unpack(data: bytes) -> tuple:
    """A trainer's message: (tag, a, b, c, d), and for RUN the epoch's interrupted runs (a list, maybe empty)."""
    msg = _MSG.unpack(data[: _MSG.size])
    if msg[0] == RUN:
        return (*msg, json.loads(data[_MSG.size :]) if len(data) > _MSG.size else [])
    return msg


def _recv(conn, parent_pid: int) -> tuple:
    """The next message to a worker; raises _ParentGone if the trainer died meanwhile."""
    while not conn.poll(1.0):
        if os.getppid() != parent_pid:
            raise _ParentGone
    try:
        return _unpack(conn.recv_bytes())
    except (EOFError, OSError) as e:
        raise _ParentGone from e


def worker_main(ds, num_workers: int, worker: int, world: tuple[int, int], shared: SharedHandle, slot_layout: SlotLayout,
                conn, parent_pid: int, ship_blocks: bool = False) -> None:
    """A worker process: map the slots, then run the passes the trainer asks for.

    ``ship_blocks`` (device mode): instead of gathering batches, stream each block's window
    table and bytes through the slots in chunks, in the order the trainer's batcher reads
    them; the trainer uploads them and cuts the windows.
    """
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _forward_warnings(conn)
    ds._world = world  # the trainer's rank: torch.distributed is not initialized here
    arr = SharedFile(slot_layout.nbytes, shared).array()
    raw = [slot_layout.slot(arr, worker, i) for i in range(slot_layout.slots)]
    slots = _Slots(raw if ship_blocks else [ds.layout().views(r) for r in raw], conn, parent_pid)
    counters = slot_layout.counters(arr, worker)
    _send(conn, READY, worker)
    totals = np.zeros(len(STAT_FIELDS), dtype=np.int64)
    plans: dict[str, Any] = {}
    cmd = None
    try:
        while True:
            msg = cmd or _recv(conn, parent_pid)
            cmd = None
            if msg[0] == STOP:
                return
            if msg[0] == RELEASE:
                slots.free.append(msg[1])
                continue
            _, run, epoch, first, _, rest = msg
            key = json.dumps([epoch, rest])
            if key not in plans:
                plans.clear()
                plans[key] = ds.plan(epoch, num_workers, rest)
            stream = world[0] * max(1, num_workers) + worker
            cmd = _run_pass(ds, plans[key], stream, run, first, slots, counters, totals, ship_blocks)
    except _ParentGone:
        return


class _Slots:
    """A worker's view of its slots: which are free, waiting for the trainer to release one."""

    def __init__(self, slots: list, conn, parent_pid: int):
        self.slots, self.conn, self.parent_pid = slots, conn, parent_pid
        self.free = deque(range(len(slots)))
        self.taken: list[int] = []  # popped for output that has not gone out yet

    def take(self):
        """A free slot (its field views, or its bytes); its number is ``taken[-1]``."""
        while not self.free:
            msg = _recv(self.conn, self.parent_pid)
            if msg[0] != RELEASE:
                raise _Interrupted(msg)
            self.free.append(msg[1])
        self.taken.append(self.free.popleft())
        return self.slots[self.taken[-1]]

    def sent(self, tag: int, run: int, nbytes: int = 0) -> None:
        """Send the slot taken first, then collect the releases (or a command) that have arrived."""
        _send(self.conn, tag, run, self.taken.pop(0), nbytes)
        while self.conn.poll(0):
            msg = _unpack(self.conn.recv_bytes())
            if msg[0] != RELEASE:
                raise _Interrupted(msg)
            self.free.append(msg[1])


def _run_pass(ds, plan, stream: int, run: int, first: int, slots: _Slots, counters: np.ndarray,
              totals: np.ndarray, ship_blocks: bool) -> tuple | None:
    """One pass of a stream into free slots; returns a command that interrupted it, or None."""
    node = source = None
    try:
        if ship_blocks:
            node, source = open_blocks(ds, plan, stream, first)
            for i, block in node:
                _ship(block, slots, run, i)
                node.release(i, block)
                counters[: len(STAT_FIELDS)] = totals + _stats(source)
        else:
            node, source = open_stream(ds, plan, stream, first, slots.take, prefetch=False)
            for _ in node:
                counters[: len(STAT_FIELDS)] = totals + _stats(source)
                slots.sent(BATCH, run)
        return None
    except _Interrupted as e:
        return e.msg
    except (_ParentGone, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # hand the error to the trainer, which raises it
        _send_error(slots.conn, run, e)
        return None
    finally:
        slots.free.extend(slots.taken)  # a slot popped for output that never went out is free again
        slots.taken.clear()
        close_stream(node)
        if source is not None:
            totals += _stats(source)
            counters[: len(STAT_FIELDS)] = totals


def _ship(block, slots: _Slots, run: int, source: int) -> None:
    """BLOCK(bytes, windows, source), then the window table and the bytes in slot-sized CHUNKs."""
    table = window_table(block)
    _send(slots.conn, BLOCK, run, len(block.buf), len(block), source)
    for part in (table, block.buf):
        for pos in range(0, len(part), len(slots.slots[0])):
            dest = slots.take()
            n = min(len(dest), len(part) - pos)
            np.copyto(dest[:n], part[pos : pos + n])  # page cache -> shared (page-locked) memory, no GIL
            slots.sent(CHUNK, run, n)


def _stats(source) -> np.ndarray:
    s = source.stats
    return np.array([getattr(s, f) for f in STAT_FIELDS], dtype=np.int64)


def _send_error(conn, run: int, e: BaseException) -> None:
    """An error as JSON (never pickle: nothing a worker sends is unpickled), with its traceback."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    where = {k: getattr(e, k, None) for k in ("shard", "member", "offset")} if isinstance(e, ShardError) else {}
    payload = {"run": run, "type": type(e).__name__, "module": type(e).__module__,
               "message": getattr(e, "reason", None) if where else str(e), "where": where, "text": text}
    with _SEND:
        conn.send_bytes(bytes([ERROR]) + json.dumps(payload, default=str).encode())


def _rebuild_error(payload: dict) -> BaseException:
    """The worker's error as the same class where that is one of ours or a builtin, else a RuntimeError."""
    if payload["where"]:
        return ShardError(payload["message"], **payload["where"])
    cls = getattr(errors, payload["type"], None) if payload["module"] == errors.__name__ else \
        getattr(builtins, payload["type"], None) if payload["module"] == "builtins" else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(payload["message"])
        except Exception:
            pass
    return RuntimeError(f"{payload['type']}: {payload['message']}")


class WorkerPool:
    """``num_workers`` processes, each with ``slots`` batch slots in one shared file (trainer side)."""

    def __init__(self, ds, num_workers: int, world: tuple[int, int], *, slots: int, pin: bool, context,
                 ship_blocks: bool = False, start_timeout: float = 120.0):
        self.num_workers, self.ship_blocks = num_workers, ship_blocks
        self.slot_layout = SlotLayout(num_workers, slots, CHUNK_BYTES if ship_blocks else ds.layout().nbytes)
        self.shm = SharedFile(self.slot_layout.nbytes)
        self.procs: list = []
        self.conns: list = []
        self.run = 0
        self.closed = False
        self.held: list[list] = []  # [worker, slot, cuda event or None]: slots handed out, not yet released
        try:
            self.pinned = pin and self.shm.pin()
            arr = self.shm.array()
            # per slot: a Region (whose reference count tells whether the slot is still held) and its bytes
            self.regions = [[self.slot_layout.region(self.shm, w, i) for i in range(slots)] for w in range(num_workers)]
            self.bases = [[r.array() for r in rs] for rs in self.regions]
            self.counters = [self.slot_layout.counters(arr, w) for w in range(num_workers)]
            for w in range(num_workers):
                mine, theirs = context.Pipe(duplex=True)
                p = context.Process(target=worker_main, name=f"streamwin-worker-{w}", daemon=True,
                                    args=(ds, num_workers, w, world, self.shm.handle(), self.slot_layout, theirs,
                                          os.getpid(), ship_blocks))
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(mine)
            deadline = time.monotonic() + start_timeout
            for w in range(num_workers):
                while not self.conns[w].poll(POLL_S):
                    self._check_alive(w)
                    if time.monotonic() > deadline:
                        raise WorkerError(f"streamwin worker {w} did not start within {start_timeout:.0f} s")
                self._message(w)
        except BaseException:
            self.close()
            raise

    def start(self, epoch: int, first_batches: list[int], rest_of: list[dict[str, Any]] = ()) -> None:
        """Begin a pass: worker w yields its stream's batches from ``first_batches[w]`` on.

        ``rest_of``: the epoch's interrupted runs after an elastic resume (the plan is the rest of the epoch).
        """
        self.run += 1
        tail = json.dumps(list(rest_of)).encode() if rest_of else b""
        for w, conn in enumerate(self.conns):
            with _SEND:
                conn.send_bytes(_MSG.pack(RUN, self.run, epoch, first_batches[w], 0) + tail)

    def take(self, w: int, on_wait: Callable[[], None]) -> int:
        """The slot holding worker ``w``'s next batch of the current pass; ``on_wait`` runs while waiting."""
        return self.receive(w, on_wait)[1]

    def receive(self, w: int, on_wait: Callable[[], None], wait: bool = True) -> tuple[int, int, int, int] | None:
        """Worker ``w``'s next BATCH(slot, 0, 0), BLOCK(bytes, windows, source) or CHUNK(slot, bytes, 0) of the current pass.

        ``on_wait`` runs while waiting; with ``wait=False``, None when nothing has arrived.
        """
        conn = self.conns[w]
        while True:
            if not conn.poll(0):
                if not wait:
                    return None
                on_wait()
                while not conn.poll(POLL_S):
                    self._check_alive(w)
                    on_wait()
            kind, run, a, b, c = self._message(w)
            if kind in (BATCH, BLOCK, CHUNK):
                if run == self.run:
                    return kind, a, b, c
                if kind != BLOCK:
                    self.release(w, a)  # from a pass abandoned midway

    def _message(self, w: int) -> tuple[int, int, int, int, int]:
        try:
            data = self.conns[w].recv_bytes()
        except (EOFError, OSError):
            self._check_alive(w, wait=1.0)
            raise WorkerError(f"streamwin worker {w} (pid {self.procs[w].pid}) closed its pipe")
        if data[0] == WARNING:
            payload = json.loads(data[1:])
            category = getattr(builtins, payload["category"], None)
            if not (isinstance(category, type) and issubclass(category, Warning)):
                category = UserWarning
            warnings.warn(f"(in streamwin worker {w}) {payload['message']}", category, stacklevel=2)
            return WARNING, self.run, -1, 0, 0
        if data[0] == ERROR:
            payload = json.loads(data[1:])
            if payload["run"] == self.run:
                raise _rebuild_error(payload) from WorkerError(
                    f"in streamwin worker {w} (pid {self.procs[w].pid}):\n{payload['text']}")
            return ERROR, payload["run"], -1, 0, 0
        return _MSG.unpack(data)

    def release(self, w: int, slot: int) -> None:
        """Give slot ``slot`` back to worker ``w``."""
        try:
            _send(self.conns[w], RELEASE, slot)
        except (BrokenPipeError, OSError):
            pass  # a dead worker is reported by take()

    def stats(self) -> np.ndarray:
        """The workers' read counters, summed (run totals)."""
        return np.sum([c[: len(STAT_FIELDS)] for c in self.counters], axis=0)

    def _check_alive(self, w: int, wait: float = 0.0) -> None:
        p = self.procs[w]
        p.join(wait) if wait else None
        code = p.exitcode
        if code is not None:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
            hint = " (out of memory?)" if code == -signal.SIGKILL else ""
            raise WorkerError(f"streamwin worker {w} (pid {p.pid}) {how}{hint}")

    def close(self) -> None:
        """Stop the workers (politely, then by force) and give up the shared memory."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                _send(conn, STOP)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
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
        self.counters = [c.copy() for c in self.counters]  # keep the totals readable, let the mapping go
