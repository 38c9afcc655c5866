"""The pipe protocol between the trainer and its worker processes: fixed 33-byte messages, no pickling.

    trainer -> worker   RUN(run, epoch, first batch)[+ JSON] | RELEASE(slot) | STOP
    worker -> trainer   READY | BATCH(run, slot)      | an error, as JSON (rare)
    device mode         BLOCK(run, bytes, table bytes, source), then CHUNK(run, slot, bytes) ...

``run`` numbers passes: after a pass is abandoned midway (persistent workers), the trainer
discards and releases what the old pass still sends. After an elastic resume, RUN carries the
epoch's interrupted runs as a JSON tail (once per pass, a few hundred bytes). Errors and
warnings travel as JSON: nothing a worker sends is ever unpickled.
"""
from __future__ import annotations

import builtins
import json
import struct
import threading
import traceback
import warnings

from streamwin import errors
from streamwin.errors import ShardError

MSG = struct.Struct("<Bqqqq")
READY, BATCH, RUN, RELEASE, STOP, ERROR, WARNING, BLOCK, CHUNK = 1, 2, 3, 4, 5, 0, 6, 7, 8
CHUNK_BYTES = 4 << 20  # slot size when workers ship blocks
SEND_LOCK = threading.Lock()  # a worker's read-ahead thread may send a warning while its main thread sends a batch


def send(conn, tag: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0, tail: bytes = b"") -> None:
    """One message (and, for RUN, its JSON tail)."""
    with SEND_LOCK:
        conn.send_bytes(MSG.pack(tag, a, b, c, d) + tail)


def forward_warnings(conn) -> None:
    """Warnings raised in a worker (on any of its threads) are raised again in the trainer."""
    def show(message, category, filename, lineno, file=None, line=None):
        payload = json.dumps({"category": category.__name__, "message": str(message)}).encode()
        with SEND_LOCK:
            conn.send_bytes(bytes([WARNING]) + payload)
    warnings.showwarning = show


def unpack(data: bytes) -> tuple:
    """A trainer's message: (tag, a, b, c, d), and for RUN the epoch's interrupted runs (a list, maybe empty)."""
    msg = MSG.unpack(data[: MSG.size])
    if msg[0] == RUN:
        return (*msg, json.loads(data[MSG.size :]) if len(data) > MSG.size else [])
    return msg


def send_error(conn, run: int, e: BaseException) -> None:
    """An error as JSON (never pickle: nothing a worker sends is unpickled), with its traceback."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    where = {k: getattr(e, k, None) for k in ("shard", "member", "offset")} if isinstance(e, ShardError) else {}
    payload = {"run": run, "type": type(e).__name__, "module": type(e).__module__,
               "message": getattr(e, "reason", None) if where else str(e), "where": where, "text": text}
    with SEND_LOCK:
        conn.send_bytes(bytes([ERROR]) + json.dumps(payload, default=str).encode())


def rebuild_error(payload: dict) -> BaseException:
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


def raise_warning(payload: dict, worker: int) -> None:
    """A worker's warning, raised again in the trainer (a category we do not know becomes UserWarning)."""
    category = getattr(builtins, payload["category"], None)
    if not (isinstance(category, type) and issubclass(category, Warning)):
        category = UserWarning
    warnings.warn(f"(in streamwin worker {worker}) {payload['message']}", category, stacklevel=3)
