"""Batch slots in shared memory: allocated once per worker pool, filled by workers, viewed by the trainer.

One shared-memory file holds, per worker, a few fixed-size batch slots (``BatchLayout.nbytes``
each), a small block of counters and the two rings of records the trainer and the worker
exchange slot numbers through (protocol.py). It has no name: a memfd on Linux, elsewhere a file in
the shm directory unlinked right after it is made. Workers get its file descriptor (inherited
with fork, passed by multiprocessing with spawn or forkserver), so nothing is ever left in
/dev/shm whatever happens (Ctrl-C, SIGTERM, SIGKILL during start-up, a crash); the memory
goes when the last process unmaps it. Per batch nothing is allocated: a worker gathers into
a free slot and sends the slot's number.

With ``pin=True`` (and CUDA) the trainer page-locks the mapping (cudaHostRegister), so a
``.to(device, non_blocking=True)`` copies straight from the slot, asynchronously.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile
import uuid
from multiprocessing import reduction

import numpy as np
import torch

from streamwin.batch import BatchKeys

PREFIX = "streamwin-"
PAGE = mmap.PAGESIZE
COUNTERS = 16  # int64 counters per worker (read statistics)
RECORD = 5  # int64 per record of a ring (protocol.Channel)


def shm_dir() -> str:
    """Where shared-memory files live: /dev/shm on Linux, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _anonymous_fd(nbytes: int) -> int:
    """A file descriptor of ``nbytes`` of shared memory that no name refers to."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(PREFIX + "slots", os.MFD_CLOEXEC)
    else:
        path = os.path.join(shm_dir(), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)  # the descriptor keeps the memory; no name is left to leak
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedHandle:
    """What a worker needs to map a SharedFile: its descriptor and size (picklable for spawn)."""

    def __init__(self, fd: int, nbytes: int):
        self.fd, self.nbytes = fd, nbytes

    def __reduce__(self):  # under spawn/forkserver, multiprocessing passes a duplicate of the descriptor
        return _rebuild_handle, (self.nbytes, reduction.DupFd(self.fd))


def _rebuild_handle(nbytes: int, dupfd) -> SharedHandle:
    return SharedHandle(dupfd.detach(), nbytes)


class SharedFile:
    """``nbytes`` of nameless shared memory mapped read-write; unmapped when the last numpy view is gone."""

    def __init__(self, nbytes: int, handle: SharedHandle | None = None):
        self.nbytes = -(-max(nbytes, 1) // PAGE) * PAGE if handle is None else handle.nbytes
        self._registered = False
        self.fd = _anonymous_fd(self.nbytes) if handle is None else handle.fd
        try:
            self._mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        probe = ctypes.c_char.from_buffer(self._mm)  # the mapping's address; released right away
        self.addr = ctypes.addressof(probe)
        del probe
        self.__array_interface__ = {"data": (self.addr, False), "shape": (self.nbytes,), "typestr": "|u1",
                                    "version": 3}

    def handle(self) -> SharedHandle:
        """For a worker: map the same memory (pass it as a Process argument)."""
        return SharedHandle(self.fd, self.nbytes)

    def array(self) -> np.ndarray:
        """A uint8 view of the whole mapping; the mapping lives as long as any view of it."""
        return np.asarray(self)

    def pin(self) -> bool:
        """Page-lock the mapping for asynchronous copies to CUDA devices; False if CUDA is absent."""
        if self._registered or not torch.cuda.is_available():
            return self._registered
        err = torch.cuda.cudart().cudaHostRegister(self.addr, self.nbytes, 0)
        self._registered = int(err) == 0
        return self._registered

    def __del__(self, _close=os.close) -> None:
        # the last view may go while the interpreter shuts down, after this module's globals (os) are gone: only
        # what the object holds and the default argument bound at definition are used here
        if getattr(self, "_registered", False):
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self.addr)
            except Exception:
                pass
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass
        if getattr(self, "fd", -1) >= 0:
            try:
                _close(self.fd)
            except OSError:
                pass
            self.fd = -1


class Region:
    """A byte range of a SharedFile as a numpy array of its own.

    numpy points a view at the nearest array whose base is not an array, so every view of
    ``Region.array()`` (and every tensor made from one) refers to that array: its reference
    count says whether anyone still holds the slot. A slice of one big array would not.
    """

    def __init__(self, shared: SharedFile, offset: int, nbytes: int):
        self.shared = shared  # keeps the mapping alive while any view of the region lives
        self.__array_interface__ = {"data": (shared.addr + offset, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}

    def array(self) -> np.ndarray:
        """The region's bytes; every view of this array refers to it."""
        return np.asarray(self)


class SlotLayout:
    """Byte offsets of each worker's counters, rings and slots inside one shared file."""

    def __init__(self, workers: int, slots: int, slot_bytes: int, ring: int = 0):
        self.workers, self.slots, self.ring = workers, slots, ring
        self.slot_bytes = -(-slot_bytes // PAGE) * PAGE
        self.header = COUNTERS + 2 * ring * RECORD  # int64 per worker: counters, then the rings
        self.slots_at = -(-(workers * self.header * 8) // PAGE) * PAGE
        self.nbytes = self.slots_at + workers * slots * self.slot_bytes

    def slot_at(self, worker: int, slot: int) -> int:
        """Byte offset of ``slot`` of ``worker`` in the file (the counters come first)."""
        return self.slots_at + (worker * self.slots + slot) * self.slot_bytes

    def slot(self, arr: np.ndarray, worker: int, slot: int) -> np.ndarray:
        """The bytes of ``slot`` of ``worker`` (a view of ``arr``, the whole file)."""
        at = self.slot_at(worker, slot)
        return arr[at : at + self.slot_bytes]

    def region(self, shared: SharedFile, worker: int, slot: int) -> Region:
        """``slot`` of ``worker`` as a Region of its own (trainer side: per-slot reference counts)."""
        return Region(shared, self.slot_at(worker, slot), self.slot_bytes)

    def counters(self, arr: np.ndarray, worker: int) -> np.ndarray:
        """The int64 counters of ``worker``."""
        at = worker * self.header * 8
        return arr[at : at + COUNTERS * 8].view(np.int64)

    def rings(self, arr: np.ndarray, worker: int) -> tuple[np.ndarray, np.ndarray]:
        """The [ring, RECORD] int64 rings of ``worker``: to the worker, then to the trainer."""
        at, n = (worker * self.header + COUNTERS) * 8, self.ring * RECORD * 8
        return (arr[at : at + n].view(np.int64).reshape(self.ring, RECORD),
                arr[at + n : at + 2 * n].view(np.int64).reshape(self.ring, RECORD))


class SlotBatches:
    """A pool's slots as the trainer hands them out: field views made once, batches made ahead.

    A slot is free when the reference counts of its arrays are back to what they were when it was
    free: every numpy view of a slot refers to its region's array or to one of its field views, and
    every tensor made from a field view (``torch.from_numpy``) refers to that view until the tensor
    and every view of it are gone. The batch a slot is handed out with (tensors over its fields,
    keys over its ``seq``) is made right after its previous batch was released, for several slots
    at once (``prepare``): after a training step the trainer's caches are cold and one torch call
    costs tens of microseconds, a few more in a row hardly anything. Keys outlive their slot: when
    only they still read it, they take a copy (``BatchKeys.detach``) and the slot is free. Packed
    rows (per-crop fields cut per batch) get no batches made ahead; device mode copies the slot's
    bytes instead (to_device.py) and takes none. ``layout`` None: a closed pool's (no slots).
    """

    def __init__(self, bases: list[list[np.ndarray]], layout=None, manifests: list | None = None):
        self.manifests = manifests
        self.fields = [[{} if layout is None else layout.views(b) for b in bs] for bs in bases]
        self.refs = [[(b, *f.values()) for b, f in zip(bs, fs)] for bs, fs in zip(bases, self.fields)]
        self.free = [[_references(r) for r in rs] for rs in self.refs]  # counts of a free slot
        self.ahead = layout is not None and not layout.has("crops")
        self.key_refs = 1 + (layout is not None and layout.has("source"))  # references of reading keys
        self.made = [[None] * len(bs) for bs in bases]  # batches made ahead, not handed out yet
        self.keys = [[None] * len(bs) for bs in bases]  # the keys a slot's batch was handed out with
        for w, bs in enumerate(bases):
            self.prepare(w, range(len(bs)))

    def take(self, w: int, slot: int) -> dict:
        """The batch of a slot about to be handed out (made ahead, or now); the slot is held while it lives."""
        batch = self.made[w][slot]
        if batch is None:
            batch = self._make(self.fields[w][slot])
        self.made[w][slot] = None
        self.keys[w][slot] = batch["key"]
        return batch

    def in_use(self, w: int, slot: int) -> bool:
        """Whether anything refers to a slot handed out; keys that alone still read it take a copy (False)."""
        extra = sum(map(sys.getrefcount, self.refs[w][slot])) - self.free[w][slot]
        keys = self.keys[w][slot]
        if keys is not None and keys.reading():
            extra -= self.key_refs  # the keys' own references (to seq, and source)
            if extra:  # a tensor or a view of the slot lives
                return True
            if sys.getrefcount(keys) > 3:  # referred to besides this list, this variable and the argument
                keys.detach()
        elif extra:
            return True
        self.keys[w][slot] = None
        return False

    def prepare(self, w: int, slots) -> None:
        """Make the batches of freed slots ahead of their next hand-out."""
        if self.ahead:
            made, fields = self.made[w], self.fields[w]
            for slot in slots:
                if made[slot] is None:
                    made[slot] = self._make(fields[slot])

    def _make(self, fields: dict) -> dict:
        """Tensors over a slot's field views (all but ``seq``) and its keys."""
        batch = {k: torch.from_numpy(v) for k, v in fields.items() if k != "seq"}
        batch["key"] = BatchKeys(manifests=self.manifests, seq=fields["seq"], source=fields.get("source"))
        return batch


def _references(arrays: tuple) -> int:
    """The reference counts of a slot's arrays, summed: above the count of a free slot, someone holds it."""
    return sum(map(sys.getrefcount, arrays))


def leftovers(pid: int | None = None) -> list[str]:
    """Shared-memory files of ours still named in the shm directory (of process ``pid``, or any)."""
    prefix = PREFIX + (f"{pid}-" if pid is not None else "")
    return sorted(n for n in os.listdir(shm_dir()) if n.startswith(prefix))
