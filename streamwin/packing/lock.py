"""The pack lock: one pack at a time commits to a destination, and a dead one is taken over.

A pack (and a merge) creates ``.streamwin-pack.lock`` at the dataset root before it touches
anything there, with an exclusive create the storage itself arbitrates (O_EXCL on a local
disk, ``If-None-Match: *`` on s3), so of two packs racing for one destination exactly one
gets it; the other stops at once with a PackError naming the holder. The lock says who
holds it (host, pid, a random token), which generation of shards that pack writes, and when
it last showed a sign of life: a thread rewrites it every HEARTBEAT_S seconds. A lock whose
holder is gone is stale and taken over by the next pack: at once when the holder ran on
this machine and its process is dead, else STALE_S seconds after its last heartbeat.
Before it commits, a pack checks that the lock is still its own (`check`).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from streamwin.errors import PackError
from streamwin.storage.urls import create_exclusive, join, remove_if_exists, write_atomic

LOCK_NAME = ".streamwin-pack.lock"
HEARTBEAT_S = 15.0  # the holder rewrites the lock this often
STALE_S = 120.0  # a lock not rewritten for this long (another machine's) is taken over


class PackLock:
    """The lock of one pack at ``root`` (see the module docstring); a context manager."""

    def __init__(self, fs, root: str, dest: str, what: str = "pack"):
        self.fs, self.path, self.dest, self.what = fs, join(root, LOCK_NAME), dest, what
        self.token = uuid.uuid4().hex
        self.gen = 0
        self.stale_gen = 0  # the generation a dead holder was writing (its files are leftovers)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _content(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": self.token, "what": self.what,
                           "gen": self.gen, "beat": time.time()}).encode()

    def acquire(self) -> "PackLock":
        """Take the lock (taking over a stale one), or PackError naming the pack that holds it."""
        for _ in range(2):
            if create_exclusive(self.fs, self.path, self._content()):
                self._beat = threading.Thread(target=self._heartbeat, name="streamwin-pack-lock", daemon=True)
                self._beat.start()
                return self
            holder = self._holder()
            if holder is not None and not _stale(holder):
                raise PackError(self._busy(holder))
            self.stale_gen = max(self.stale_gen, int((holder or {}).get("gen", 0) or 0))
            remove_if_exists(self.fs, self.path)  # a dead pack's lock: take it over
        raise PackError(f"cannot lock {self.dest}: another pack took over its stale lock at the same time; retry")

    def _busy(self, holder: dict) -> str:
        age = time.time() - float(holder.get("beat", 0))
        return (f"{self.dest} is locked by another {holder.get('what', 'pack')} (pid {holder.get('pid')} on "
                f"{holder.get('host')}, last seen {age:.0f} s ago): two packs cannot commit to one destination. "
                f"Wait for it to finish; a pack that died is taken over at once on its own machine, or {STALE_S:.0f} s "
                f"after its last sign of life elsewhere ({join(self.dest, LOCK_NAME)})")

    def _holder(self) -> dict | None:
        """The lock's content, or None when it is gone (then it can be taken)."""
        for attempt in range(3):
            try:
                doc = json.loads(self.fs.cat_file(self.path))
                return doc if isinstance(doc, dict) else {"beat": 0}
            except FileNotFoundError:
                return None
            except ValueError:  # not a lock pack wrote (they are written whole): look again, then call it stale
                time.sleep(0.05 * (attempt + 1))
        return {"beat": 0}

    def set_generation(self, gen: int) -> None:
        """Record the generation of shards this pack writes (a pack that takes over learns it)."""
        self.gen = gen
        self._write()

    def _write(self) -> None:
        write_atomic(self.fs, self.path, self._content())  # a reader never sees half a lock

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            holder = self._holder()
            if holder is None or holder.get("token") != self.token:
                return  # taken over: never overwrite another pack's lock
            try:
                self._write()
            except Exception:  # a storage hiccup: the next beat tries again
                pass

    def check(self) -> None:
        """PackError unless the lock is still this pack's (a pack that lost it must not commit)."""
        holder = self._holder()
        if holder is None or holder.get("token") != self.token:
            raise PackError(f"this {self.what} lost its lock on {self.dest} (it was taken over as stale, or removed): "
                            "it does not commit; the dataset there is left as it was")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this pack's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        try:
            holder = self._holder()
            if holder is not None and holder.get("token") == self.token:
                remove_if_exists(self.fs, self.path)
        except Exception:  # leaving a lock behind is safe: it goes stale
            pass

    def __enter__(self) -> "PackLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _stale(holder: dict) -> bool:
    """A holder that cannot be alive: its process is gone from this machine, or it has not beaten for STALE_S."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, under another user
            return False
        if holder["pid"] != os.getpid():
            return False
    try:
        return time.time() - float(holder.get("beat", 0)) > STALE_S
    except (TypeError, ValueError):
        return True
