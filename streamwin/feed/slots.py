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
import operator
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
RECORD = 17  # int64 per record of a ring (protocol.Channel): a tag and 16 values (a RELEASE gives back 16 slots)
STACK = 2048  # int64 per worker where its watchdog writes its main thread's stack when asked (16 KiB: watch.py)


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
    """Byte offsets of each worker's counters, rings and slots inside one shared file (``shared``: the workers
    share ``slots`` slots, each writing its rows of every batch, instead of ``slots`` each)."""

    def __init__(self, workers: int, slots: int, slot_bytes: int, ring: int = 0, shared: bool = False):
        self.workers, self.slots, self.ring, self.shared = workers, slots, ring, shared
        self.slot_bytes = -(-slot_bytes // PAGE) * PAGE
        self.header = COUNTERS + 2 * ring * RECORD + STACK  # int64 per worker: counters, the rings, its stack
        self.slots_at = -(-(workers * self.header * 8) // PAGE) * PAGE
        self.nbytes = self.slots_at + (1 if shared else workers) * slots * self.slot_bytes

    def slot_at(self, worker: int, slot: int) -> int:
        """Byte offset of ``slot`` of ``worker`` (of them all, shared) in the file (the counters come first)."""
        return self.slots_at + ((0 if self.shared else worker) * self.slots + slot) * self.slot_bytes

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

    def stack(self, arr: np.ndarray, worker: int) -> np.ndarray:
        """The bytes where ``worker``'s watchdog writes its stack (a length, then the text)."""
        at = (worker * self.header + COUNTERS + 2 * self.ring * RECORD) * 8
        return arr[at : at + STACK * 8]

    def rings(self, arr: np.ndarray, worker: int) -> tuple[np.ndarray, np.ndarray]:
        """The [ring, RECORD] int64 rings of ``worker``: to the worker, then to the trainer."""
        at, n = (worker * self.header + COUNTERS) * 8, self.ring * RECORD * 8
        return (arr[at : at + n].view(np.int64).reshape(self.ring, RECORD),
                arr[at + n : at + 2 * n].view(np.int64).reshape(self.ring, RECORD))


class SlotState:
    """One slot as the trainer hands it out: its field views, tensors and keys, and the counts that say it is free.

    One object per slot, so that looking at a held slot after a training step (cold caches)
    touches it and the objects it watches, not a list per attribute."""

    __slots__ = ("fields", "made", "tensors", "pointers", "watch", "storages", "addresses", "keys", "free")

    def __init__(self, fields: dict[str, np.ndarray]):
        self.fields = fields
        self.made: dict = {}  # its tensors and keys, handed out as a new dict
        self.tensors: tuple = ()
        self.pointers: list = []  # the tensors' data pointers when made (into the slot)
        self.watch: tuple = ()  # the arrays or tensors whose references tell
        self.storages: tuple = ()  # the tensors' storages, kept alive
        self.addresses: tuple = ()  # the storages' addresses
        self.keys: BatchKeys | None = None  # the keys its batch is handed out with
        self.free = 0  # reference and use counts of the slot free


class SlotBatches:
    """A pool's slots as the trainer hands them out: field views and tensors made once, handed out again.

    A slot is free when nothing outside refers to it: every numpy view of a slot refers to its
    region's array (its reference count tells), and every view of a slot's tensors shares the
    tensor's storage (the storage's use count tells); a tensor held refers to itself. Each slot's
    tensors are made once and handed out again in a new dict while nothing refers to them: after
    a training step the trainer's caches are cold and each torch call costs tens of microseconds,
    so a batch costs a dict copy, not a tensor per field. A tensor changed in place (its version
    moved: shape, strides, storage, or data), set to require grad, or whose data moved without
    a version (``.data =``, ``share_memory_()``, as a torch.multiprocessing queue does) is made
    anew before its slot's next hand-out, never handed out pointing elsewhere. Keys outlive their
    slot: when only they still read it, they take a copy (``BatchKeys.detach``) and the slot gets
    new ones. Packed rows (per-crop fields cut per batch) get no tensors made ahead (a batch's
    tensors refer to the field views, which are watched then); device mode copies the slot's
    bytes instead (to_device.py) and takes none. ``layout`` None: a closed pool's (no slots).
    """

    def __init__(self, bases: list[list[np.ndarray]], layout=None, manifests: list | None = None):
        self.manifests = manifests
        self.bases = bases
        self.ahead = layout is not None and not layout.has("crops")
        self.slots = [[SlotState({} if layout is None else layout.views(b)) for b in bs] for bs in bases]
        for w, states in enumerate(self.slots):
            for slot, state in enumerate(states):
                self._make(state, self.bases[w][slot])

    def in_use(self, state: SlotState) -> bool:
        """Whether anything refers to a slot handed out; keys that alone still read it take a copy (False).
        A free slot whose tensors were changed in place (data, shape, strides, storage) or set to require
        grad, or whose data moved, gets new ones."""
        extra = sum(map(sys.getrefcount, state.watch)) + sum(map(_use_count, state.addresses)) - state.free
        tensors = state.tensors
        moved = (any(map(_VERSION, tensors)) or any(map(_GRAD, tensors))
                 or list(map(_DATA_PTR, tensors)) != state.pointers)
        if moved:  # a tensor that left its storage (set_, .data =) no longer counts in its use count
            extra += sum(t.untyped_storage().data_ptr() != st.data_ptr() for t, st in zip(tensors, state.storages))
        keys = state.keys
        if keys is not None and keys.reading():
            if extra:  # a tensor or a view of the slot lives
                return True
            if sys.getrefcount(keys) > 3 + self.ahead:  # held besides by the slot (twice), this variable, the argument
                keys.detach()
                self._new_keys(state)
        elif extra:
            return True
        elif self.ahead:  # keys decoded or detached: the next batch gets new ones
            self._new_keys(state)
        del keys, tensors
        if moved:
            self._make(state, state.watch[0])
        return False

    def _make(self, state: SlotState, base: np.ndarray) -> None:
        """A slot's tensors (every field but ``seq``) and keys, and the counts of the slot free."""
        tensors: tuple = ()
        if self.ahead:
            batch = {k: torch.from_numpy(v) for k, v in state.fields.items() if k != "seq"}
            tensors = tuple(batch.values())
            state.made = batch
            self._new_keys(state)
        state.tensors = tensors
        state.pointers = list(map(_DATA_PTR, tensors))
        # every numpy view of the slot refers to its region's array; with tensors made, only they and the keys refer
        # to the field views (the keys are looked at apart); without, a batch's tensors refer to the field views
        state.watch = (base, *(tensors if self.ahead else state.fields.values()))
        del base, tensors  # the counts of the slot free are taken with no reference from here
        state.storages = tuple(t.untyped_storage() for t in state.tensors)  # alive if a tensor is set_ elsewhere
        state.addresses = tuple(st._cdata for st in state.storages)
        state.free = sum(map(sys.getrefcount, state.watch)) + sum(map(_use_count, state.addresses))

    def _new_keys(self, state: SlotState) -> None:
        """New keys over a slot's ``seq`` (and ``source``) for its next batch."""
        fields = state.fields
        state.keys = state.made["key"] = BatchKeys(manifests=self.manifests, seq=fields["seq"],
                                                   source=fields.get("source"))


# Torch internals, because nothing public tells whether a slot is free while its tensors are handed out again. A
# slot's tensors are made once and kept by the loader, so a batch costs a dict copy, not a torch call a field (tens of
# microseconds each with the trainer's caches cold: benchmarks/next_cost.py). What still says that a training loop
# holds a view of one (x[0], x.view(...), x.numpy()) is then only the count of references to the storage the views
# share: a weakref to a tensor, the reference count of a tensor or of its numpy memory, or a storage's Python object
# stay the same while the loader holds its own tensors (a view refers to the storage and its base in C++, not to
# their Python objects), and letting go of them would mean making them again each batch. torch's own CUDA graph trees
# read the count the same way. A tensor's in-place version is one attribute read, where comparing shape, strides,
# offset and storage would be several calls a tensor. tests/test_feed_handoff.py
# (test_the_torch_internals_that_tell_a_slot_free_still_mean_what_slots_reads) fails, naming the torch version, on a
# torch that drops or changes either.
_use_count = torch._C._storage_Use_Count  # references to a storage by its address (``_cdata``): one a tensor over it
_VERSION = operator.attrgetter("_version")  # bumped by every in-place change of a tensor (data, shape, storage)
_GRAD = operator.attrgetter("requires_grad")
_DATA_PTR = torch.Tensor.data_ptr  # moves without a version with .data = or share_memory_()


def leftovers(pid: int | None = None) -> list[str]:
    """Shared-memory files of ours still named in the shm directory (of process ``pid``, or any)."""
    prefix = PREFIX + (f"{pid}-" if pid is not None else "")
    return sorted(n for n in os.listdir(shm_dir()) if n.startswith(prefix))
