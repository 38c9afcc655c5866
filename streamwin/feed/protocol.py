"""The protocol between the trainer and its worker processes: fixed records in shared memory, no pickling.

    trainer -> worker   RUN(run, epoch, first batch) + JSON | RELEASE(slots) | STOP
    worker -> trainer   READY | BATCH(run, slot)      | an error or a warning, as JSON (rare)

Each direction is a ``Channel``: a ring of 17-integer records (a tag and 16 values) in the shared file (slots.py), a
semaphore counting the records in it and one counting the free places. The sender writes a
record, then posts; the receiver takes a count, then reads the record at its own tail. A post
is a release and a take an acquire, so a record is read only once it is whole, on any CPU;
and neither is a system call unless the other side sleeps in it (glibc counts a semaphore's
waiters: a post wakes only a sleeper). Per batch the trainer thus makes no system call while
its worker keeps ahead, and wakes a sleeping worker once per ``RELEASE`` of up to 16 slots.

A message with a payload (an error, a warning, a RUN's JSON tail) is written to the pipe first
and announced by its record; the receiver reads it from the pipe when it reads the record, so
order is kept. ``run`` numbers passes: after a pass is abandoned midway (persistent workers),
the trainer discards and releases what the old pass still sends. Errors and warnings travel as
JSON: nothing a worker sends is ever unpickled.
"""
from __future__ import annotations

import builtins
import json
import struct
import threading
import traceback
import warnings
from typing import Any, Callable

import numpy as np

from streamwin import errors
from streamwin.errors import ShardError
from streamwin.feed.slots import RECORD

READY, BATCH, RUN, RELEASE, STOP, ERROR, WARNING = 1, 2, 3, 4, 5, 0, 6
PIPED = (ERROR, WARNING)  # their payload waits in the pipe
PER_RELEASE = RECORD - 1  # slots one RELEASE record gives back (-1: none)
_ZEROS = (0,) * (RECORD - 1)  # a record's values past those given
RECORD_STRUCT = struct.Struct(f"={RECORD}q")  # a record in the ring: native int64 (both sides on one machine)


def ring_size(slots: int) -> int:
    """Records a channel's ring holds: a BATCH for every slot, and as many more for warnings and commands."""
    return 2 * slots + 8


class Channel:
    """One direction between the trainer and a worker: a ring of records, its two semaphores and the pipe.

    ``ring``: [size, RECORD] int64 in shared memory; ``items`` (starts at 0) and ``space`` (starts at
    the ring's size): multiprocessing semaphores; ``conn``: this side's end of the pipe.
    """

    def __init__(self, ring: np.ndarray, items: Any, space: Any, conn: Any):
        self.items, self.space, self.conn = items, space, conn
        self.size = len(ring)
        self.buf = memoryview(ring).cast("B")  # records packed and unpacked in place: no array per record
        self.head = self.tail = 0  # records sent by this side / taken by this side (each side uses one)
        self.lock = threading.Lock()  # a worker's read-ahead thread may send a warning while its main thread sends

    # -- sending --------------------------------------------------------------------------------------
    def send(self, tag: int, *values: int, payload: bytes = b"", waiting: Callable[[], None] | None = None,
             wait: bool = True) -> bool:
        """One record, ``tag`` and up to RECORD - 1 ``values`` (0 past them), its payload first, into the pipe;
        False if the ring is full and not ``wait``.

        While the ring stays full, ``waiting()`` runs every second (to raise if the other side died).
        """
        with self.lock:
            if not self.space.acquire(False):
                if not wait:
                    return False
                while not self.space.acquire(True, 1.0):
                    if waiting is not None:
                        waiting()
            if payload:
                self.conn.send_bytes(payload)
            RECORD_STRUCT.pack_into(self.buf, self.head % self.size * RECORD_STRUCT.size, tag, *values,
                                    *_ZEROS[len(values):])
            self.head += 1
            self.items.release()
            return True

    # -- receiving ------------------------------------------------------------------------------------
    def receive(self, timeout: float = 0.0) -> tuple[int, ...] | None:
        """The next record, (tag, RECORD - 1 values), or None if none came within ``timeout`` s. A record that
        announces a payload (``has_payload``) is followed by ``payload()`` before the next ``receive``."""
        if not self.items.acquire(False) and not (timeout and self.items.acquire(True, timeout)):
            return None
        record = RECORD_STRUCT.unpack_from(self.buf, self.tail % self.size * RECORD_STRUCT.size)
        self.tail += 1
        self.space.release()
        return record

    def payload(self) -> bytes:
        """The payload of the record just received (it waits in the pipe)."""
        return self.conn.recv_bytes()


def has_payload(record: tuple) -> bool:
    """Whether a record's payload waits in the pipe: errors, warnings, a RUN (its interrupted runs, free slots)."""
    return record[0] in PIPED or record[0] == RUN


def forward_warnings(channel: Channel) -> None:
    """Warnings raised in a worker (on any of its threads) are raised again in the trainer."""
    def show(message, category, filename, lineno, file=None, line=None):
        channel.send(WARNING, payload=json.dumps({"category": category.__name__, "message": str(message)}).encode())
    warnings.showwarning = show


def send_error(channel: Channel, run: int, e: BaseException) -> None:
    """An error as JSON (never pickle: nothing a worker sends is unpickled), with its traceback."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    where = {k: getattr(e, k, None) for k in ("shard", "member", "offset")} if isinstance(e, ShardError) else {}
    args = list(e.args) if all(isinstance(a, (str, int, float, bool)) for a in e.args) else None
    payload = {"run": run, "type": type(e).__name__, "module": type(e).__module__,
               "message": getattr(e, "reason", None) if where else str(e), "where": where, "text": text,
               "args": args}  # rebuilt from its arguments: str(KeyError('k')) is "'k'", quoted once more
    channel.send(ERROR, run, payload=json.dumps(payload, default=str).encode())


def rebuild_error(payload: dict) -> BaseException:
    """The worker's error as the same class where that is one of ours or a builtin, else a RuntimeError."""
    if payload["where"]:
        return ShardError(payload["message"], **payload["where"])
    cls = getattr(errors, payload["type"], None) if payload["module"] == errors.__name__ else \
        getattr(builtins, payload["type"], None) if payload["module"] == "builtins" else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        args = payload.get("args")
        for given in ([args] if isinstance(args, list) and args else []) + [[payload["message"]]]:
            try:
                return cls(*given)
            except Exception:
                pass
    return RuntimeError(f"{payload['type']}: {payload['message']}")


def raise_warning(payload: dict, worker: int) -> None:
    """A worker's warning, raised again in the trainer (a category we do not know becomes UserWarning)."""
    category = getattr(builtins, payload["category"], None)
    if not (isinstance(category, type) and issubclass(category, Warning)):
        category = UserWarning
    warnings.warn(f"(in streamwin worker {worker}) {payload['message']}", category, stacklevel=3)
