"""WindowLoader: runs a rank's streams and hands their batches to the training loop.

Three ways to run, one interface (StatefulDataLoader's: iteration, ``len``, ``set_epoch``,
``state_dict``/``load_state_dict``), the same batches bit for bit:

- ``num_workers=0``: the rank's one stream runs in the trainer's process (blocks mapped or
  read on a background thread, each batch one GIL-free copy on the trainer's thread).
- ``num_workers=N``: N worker processes each run a stream and gather batches into batch
  slots in shared memory, allocated once; the trainer takes the slot numbers waiting in a ring
  in that memory, every batch at hand in one go, and ``next()`` pops one (feed/feeds.py,
  feed/pool.py). Batches are taken round robin, worker ``j % N`` for batch ``j``. The default is
  one worker where the machine has a core to spare for it (and ``fork``): 0 and 1 workers run the
  same plan (one stream per rank), so the choice never differs in what a rank yields, only in
  whose thread gathers it.
- ``device="cuda"``: batches arrive on the device, and the trainer's thread never waits for it.
  With workers, each batch goes from its page-locked slot to the device in one copy on a side
  stream (feed/to_device.py); in-process, each block's bytes are uploaded once by the read-ahead
  thread and windows are cut on the device (feed/device.py). ``static=True``: every batch in the
  same device tensors, so a training step can be captured in a CUDA graph.

Batch lifetime: a batch's tensors are never overwritten while you hold any of them (or a
view): memory is reused only once nothing refers to it, and, for page-locked slots, once
the CUDA work queued before that point has finished. Keep as many batches as you like; if
you keep so many that workers would run out of slots, the loader copies later batches out
of shared memory (and warns once). Static batches (``static=True``) are the exception: the
same tensors every batch, valid until the next ``next()``.

The position (state.Position) is a cursor: epoch and batches handed out, plus the plan inputs
it must match. Ranks run in lockstep, so any one rank's position is every rank's. A position
loaded into another world, worker count or batch size (elastic resume) makes the rest of that
epoch a plan of its own: what the interrupted run had not yielded, dealt anew (plan.rest_plan).
"""
from __future__ import annotations

import errno
import json
import logging
import warnings
from typing import Any, Callable

import numpy as np
import torch

from streamwin.arguments import check_keywords
from streamwin.dataset import WindowDataset
from streamwin.errors import StateMismatchError
from streamwin.feed.device_feeds import DeviceFeed, WorkerDeviceFeed
from streamwin.feed.feeds import Feed, FeedContext, LocalFeed, Pass, WorkerFeed
from streamwin.feed.stopping import closed, held, opened
from streamwin.feed.context import default_start_method, default_workers, start_context
from streamwin.feed.pool import WorkerPool
from streamwin.feed.sizing import check_memory, check_workers, idle_workers, slots_text
from streamwin.feed.stats import RunStats
from streamwin.feed.to_device import Fixed
from streamwin.options import MOVED
from streamwin.plan.epoch import Plan
from streamwin.state import STATE_VERSION, Position, check_state, read_state, same_position
from streamwin.transform import TIMEOUT_S, check_timeout, transformed

log = logging.getLogger("streamwin")
class NonFiniteData(RuntimeWarning):
    """A dataset whose manifest counts NaN or inf values is about to be trained on."""


def _device(device: Any) -> torch.device | None:
    """The device batches go to; a CUDA device without CUDA is refused here, saying so."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be None or a torch device such as 'cuda' or 'cuda:1', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(f"device={device!r}, but {why} (torch {torch.__version__}); pass device=None for CPU tensors")
    return dev


@check_keywords()
class WindowLoader:
    """Yields the batches of ``dataset`` for this rank; ``len()`` is equal on every rank.

    Args:
        dataset: a streamwin.WindowDataset (window spec, batch size, shuffle, splits).
        num_workers: worker processes, each running one stream of the plan (0: in-process).
            Part of the plan beyond 1: the same on every rank, and a checkpoint resumes with the
            same. Default: 1 where a core is free for it and ``fork`` is available, else 0.
        device: None (CPU tensors) or a torch device; every field but ``key`` arrives there, and this
            process never waits for the device. With workers, they gather batches into page-locked
            slots and each batch goes to the device in one copy on a side stream; with
            ``num_workers=0`` the read-ahead thread uploads each block's bytes once and windows are
            cut on the device.
        static: with ``device``, deliver every batch in the same device tensors (fields and shapes
            fixed), so a training step can be captured in a CUDA graph and replayed on each batch.
            A static batch is valid until the next ``next()``: clone what you keep.
        pin_memory: page-lock the batch memory (CUDA only) so ``.to(device, non_blocking=True)``
            is asynchronous.
        prefetch_factor: batches each worker may have ready ahead of the trainer (1 to 1024).
        persistent_workers: keep the worker processes between epochs (on remote storage what a worker's reads
            learnt, its connections and the next epoch's first blocks, read early, carry over to the next epoch).
        transform: ``fn(batch, rng) -> batch`` on each batch (a dict of numpy arrays, fields included),
            in the worker process (in-process: where batches are gathered) before the hand-off;
            ``rng`` draws row i of every draw from window i's own stream (seed, epoch, the window:
            window_random.py), so a random transform gives the same global batches in any world
            and after any resume. It keeps the rows; its outputs' shapes and dtypes are fixed after
            the first batch (streamwin/transform.py). Must be picklable for "spawn" and "forkserver".
            ``loader.dataset`` is the dataset the loader streams: ``dataset``, carrying this transform.
        timeout: seconds the trainer waits for a worker's next batch before a WorkerError naming the worker and
            where it is (its Python stack: a transform that hangs), warned about with the same at 60 s (or
            half the timeout); also the limit for the transform's first call, on zeros, when the loader is
            made. None: wait for ever (the warning still comes). As DataLoader's ``timeout``, for workers.
        multiprocessing_context: start method for workers: a name ("fork", "spawn", "forkserver") or a
            multiprocessing context object (``multiprocessing.get_context(...)``), as DataLoader takes. Where
            fork cannot be used (CUDA initialized before the loader starts), use "forkserver": its
            server imports torch and streamwin once and forks every worker from there (first batch
            with 8 workers on 2 cores: 3.2 s at 1M sequences, against 22.6 s with "spawn").
    """

    def __init__(self, dataset: WindowDataset, *, num_workers: int | None = None, device: str | torch.device | None = None,
                 static: bool = False, pin_memory: bool = False, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, multiprocessing_context: Any = None,
                 transform: Callable[[dict, Any], dict] | None = None, timeout: float | None = TIMEOUT_S,
                 **kwargs: Any):
        if not isinstance(dataset, WindowDataset):
            raise TypeError(f"WindowLoader needs a streamwin.WindowDataset, got {type(dataset).__name__}")
        if kwargs.get("batch_size") is not None:
            raise ValueError("set batch_size on the WindowDataset: batches are formed inside the streams")
        kwargs.pop("batch_size", None)
        for key in sorted(kwargs.keys() & MOVED.keys()):  # a dataset's option: named where it goes
            raise TypeError(f"WindowLoader({key}=...) is the dataset's: pass WindowDataset(..., {MOVED[key]})")
        if kwargs:
            raise TypeError(f"WindowLoader got unexpected arguments: {', '.join(sorted(kwargs))}")
        if num_workers is None:  # a worker process when a core is free for it
            num_workers = default_workers(multiprocessing_context)
        pf = 2 if prefetch_factor is None else prefetch_factor
        self.num_workers, self.prefetch_factor = check_workers(num_workers, pf)  # before anything starts
        self.device = _device(device)
        if not isinstance(static, bool):
            raise ValueError(f"static must be True or False, got {static!r}")
        if static and self.device is None:
            raise ValueError("static=True delivers batches in fixed device tensors: pass device='cuda' (or 'cpu') too")
        self.static = static
        self._fixed: Fixed | None = None  # static batches' tensors, the same for every pass
        self.pin_memory = bool(pin_memory)
        self.persistent_workers = bool(persistent_workers) and self.num_workers > 0
        self.multiprocessing_context = start_context(multiprocessing_context or default_start_method())
        self.batch_size = dataset.batch_size
        self.timeout = check_timeout(timeout)
        # what the streams run, planned and checkpointed: the dataset, with this loader's transform (states and plan
        # inputs know nothing of it)
        self.dataset = transformed(dataset, transform, self.device, self.num_workers, self.multiprocessing_context,
                                   self.timeout)
        self.position = Position()
        self._epoch_set = False  # set_epoch called since the last pass began
        self._resume = False  # a loaded position waits for the next pass
        self._feed: Feed | None = None
        self._pool: WorkerPool | None = None
        self._len: tuple[Any, int] | None = None  # ((world size, interrupted runs), batches per rank)
        self._logged = False
        self._stats = RunStats()

    # -- the epoch and the position --------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the current (or next) pass."""
        return self.position.epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (the same on every rank) before a pass; a new epoch, a new order.

        Without it, a pass that follows a complete epoch is the next epoch (the same on every
        rank, and after a resume too), and one that follows a pass abandoned midway starts
        that epoch again. After ``load_state_dict``, ``set_epoch`` with the state's own epoch
        keeps the restored position (at an epoch's end: an empty pass).
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if not (self._resume and epoch == self.position.epoch):
            self.position.epoch, self._resume = int(epoch), False
            self.position.restart()
        self._epoch_set = True

    def __len__(self) -> int:
        """Batches each rank yields in the epoch, counted as the cursor counts them: the same on every rank.

        Every epoch has the same length, except one resumed in another world, worker count or batch
        size (elastic resume): its length is the batches taken before the interruption plus the
        rest, as this job deals it. Cached per world size: a len() taken before
        ``init_process_group`` is not kept after it.
        """
        key = (self.dataset.world()[1], json.dumps(self.position.rest))
        if self._len is None or self._len[0] != key:
            self._len = (key, self.position.offset + self._plan().batches_per_rank)
        return self._len[1]

    def _plan(self) -> Plan:
        """This pass's plan: the epoch's, or the rest of it after an elastic resume."""
        return self.dataset.plan(self.position.epoch, self.num_workers, self.position.rest)

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and batches handed out, with the plan inputs (a few hundred bytes).

        The same on every rank: load any rank's into every rank of a new job, of this world or another.
        """
        return self.position.to_state(self.dataset.plan_inputs(self.num_workers))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a position; the next pass (after ``set_epoch`` with the same epoch, or none) continues it.

        In the world, workers and batch size it was taken under, the rest of the epoch is exactly
        what the interrupted run would have yielded. Under others (elastic resume), the windows
        it had not yielded are dealt anew over this job's streams: none is yielded twice, fewer
        than streams x batch_size are dropped, and every rank yields the same number of batches.
        """
        epoch, taken, inputs, rest = read_state(state_dict)
        now = self.dataset.plan_inputs(self.num_workers)
        for run in rest:  # an earlier elastic resume of this epoch: its runs must be of this dataset too
            check_state({"version": STATE_VERSION, "inputs": run["inputs"]}, now, finished=True)
        check_state({"version": STATE_VERSION, "inputs": inputs}, now, finished=True)  # data, order, windows
        done = int(rest[-1]["batches"]) if rest else 0
        planned = done + self.dataset.plan_of(inputs, epoch, rest).batches_per_rank
        if taken > planned:  # not a position of that epoch (hand-edited?): never skip an epoch for it
            raise StateMismatchError(f"not a usable streamwin loader state: field batches is {taken}, more than the "
                                     f"{planned} batches per rank of epoch {epoch} under its plan inputs")
        finished = taken == planned  # at the end of the epoch of the plan it was taken under
        self.close_pass()
        self._resume, self._epoch_set = True, False
        pos = self.position
        pos.epoch = epoch
        if finished:  # an epoch's end is the end, in any world
            pos.rest = []
            pos.taken = len(self)
        elif same_position(inputs, now):
            pos.rest, pos.taken = list(rest), taken
        elif taken == 0 and not rest:  # nothing taken yet: the epoch starts afresh in this world
            pos.restart()
        else:  # elastic: the rest of the epoch, dealt over this world
            pos.rest, pos.taken = [*rest, {"inputs": inputs, "batches": taken}], taken

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Pass:
        return Pass.of(self._begin, self.__len__)

    def _begin(self) -> Feed:
        """Start a pass: the one iterator that moves this loader's position (an earlier one stops). A Ctrl-C
        meanwhile is held until the workers are started (or stopped), then raised (feed/stopping.py)."""
        try:
            with held():
                return self._start_pass()
        except BaseException:
            self._fail_pass()
            raise

    def _start_pass(self) -> Feed:
        self.close_pass()
        pos = self.position
        if pos.taken >= len(self) > 0 and not self._epoch_set:  # the epoch is done: on to the next one
            pos.epoch += 1
            pos.restart()
        elif not self._resume:  # a new pass of this epoch (after set_epoch, or after one abandoned midway)
            pos.restart()
        self._resume = self._epoch_set = False
        world = self.dataset.world(refresh=True)  # resolved here, in the trainer, before workers start
        self._check_fits(world[1])
        plan = self._plan()
        self._log_once(world, plan)
        self._stats.start()
        ctx = FeedContext(self.dataset, self._stats, self.close_pass, self._worker_pool(world), self.device,
                          self.pin_memory, self.num_workers, on_error=self._fail_pass)
        opened(self)  # closed at exit, if not before
        if self.device is not None:
            if self.static and self._fixed is None:
                self._fixed = Fixed(self.dataset.layout(), self.device)
            self._feed = WorkerDeviceFeed(ctx, plan, pos, self._fixed) if self.num_workers else \
                DeviceFeed(ctx, plan, pos, world[0], self._fixed)
        elif self.num_workers > 0:
            self._feed = WorkerFeed(ctx, plan, pos)
        else:
            self._feed = LocalFeed(ctx, plan, pos, world[0])
        return self._feed

    def close_pass(self) -> None:
        """Stop the current pass (its threads; its workers unless they persist), a Ctrl-C held meanwhile."""
        with held():
            if self._feed is not None:
                self._feed.close()
                self._feed = None
            if self._pool is not None and not self.persistent_workers:
                self._close_pool()

    def _fail_pass(self) -> None:
        """A pass raised: stop it and its workers, persistent or not (the next pass starts fresh ones)."""
        try:
            self.close()
        except Exception:  # the error being raised says what went wrong; a second one would hide it
            log.debug("closing a failed pass", exc_info=True)

    def close(self) -> None:
        """Stop everything this loader started: threads, worker processes, shared memory."""
        with held():
            self.close_pass()
            self._close_pool()
            for source in self.dataset.sources:  # the readers its in-process streams gave back
                source.close_readers()
            closed(self)

    def __del__(self) -> None:
        try:
            with held(finalizer=True):  # a Ctrl-C raised in __del__ would be lost: delivered again after it
                self.close()
        except Exception:
            pass

    def _close_pool(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()
            self._stats.reads += pool.stats()

    def _worker_pool(self, world: tuple[int, int]) -> WorkerPool | None:
        """The worker processes of this loader (started on first use; None without workers)."""
        if not self.num_workers:
            return None
        if self._pool is None or self._pool.closed:
            to_cuda = self.device is not None and self.device.type == "cuda"
            try:
                self._pool = WorkerPool(self.dataset, self.num_workers, world, slots=self.prefetch_factor + 2,
                                        pin=self.pin_memory or to_cuda, context=self.multiprocessing_context,
                                        timeout=self.timeout)
            except OSError as e:
                if e.errno not in (errno.ENOMEM, errno.ENOSPC, errno.EMFILE, errno.EAGAIN):
                    raise
                what = slots_text(self.dataset, self.num_workers, self.prefetch_factor)
                raise ValueError(f"{what}: the system refused them ({e.strerror}): make them smaller or fewer") from e
        return self._pool

    def _check_fits(self, world_size: int) -> None:
        """Refuse, before anything is allocated, arguments whose buffers cannot fit in memory (saying how much)."""
        self.dataset.check_fits()
        check_memory(self.dataset, self.num_workers, self.prefetch_factor)

    def _log_once(self, world: tuple[int, int], plan: Plan) -> None:
        if self._logged:
            return
        self._logged = True
        warn_about_data(self.dataset)
        idle = idle_workers(self.dataset, plan, self.num_workers)
        if idle:
            warnings.warn(idle, RuntimeWarning, stacklevel=5)
        summary = self.dataset.summary(self.position.epoch, self.num_workers)
        if world[0] == 0:
            log.info("%s", summary)
        if summary["batches_per_rank"] == 0:
            ds = self.dataset
            warnings.warn(
                f"streamwin: this loader yields 0 batches per rank: {summary['windows_per_epoch']} windows for "
                f"{summary['streams']} streams of batch_size {ds.batch_size} (window {ds.spec.window} + horizon "
                f"{ds.spec.horizon} vs. your sequence lengths). Use a smaller window or batch, fewer workers, or "
                "crops=sw.Crops(pad=True) (one zero-padded window per short sequence).", RuntimeWarning, stacklevel=5)

    def summary(self) -> dict[str, Any]:
        """The dataset's numbers for this loader's plan: windows, dropped, batches per rank, streams."""
        return self.dataset.summary(self.position.epoch, self.num_workers)

    def stats(self) -> dict[str, Any]:
        """Run totals since this loader was made: batches, windows, windows/s, data-wait, reads, retries, skips."""
        reads = self._stats.reads.copy()
        if self._pool is not None:
            reads += self._pool.stats()
        device, batches = self._stats.device, 0
        if self._feed is not None:
            reads += self._feed.read_counters()
            device, batches = self._feed.device_totals(), self._feed.batches()
        out = self._stats.report(self.batch_size, reads, device, batches)
        return {**{k: out.pop(k) for k in ("batches", "windows", "windows_per_s", "wait_s")},
                "epoch": self.position.epoch, "batches_in_epoch": self.position.taken, **out}


def warn_about_data(ds: WindowDataset) -> None:
    """Once, when iteration starts: sources whose manifest counts NaN/inf, or carries no chunk checksums."""
    for source in ds.sources:
        m = source.manifest
        if m.nonfinite is not None and m.nonfinite.nan + m.nonfinite.inf and ds.missing != "mask":
            warnings.warn(
                f"streamwin: {source.url} holds {m.nonfinite.nan:,} NaN and {m.nonfinite.inf:,} inf values (counted "
                "by pack, in index.json); windows that cover them reach the model as they are. Repack with "
                "nan='raise' to find them, clean them before packing, or pass crops=sw.Crops(missing='mask') to mask "
                "them",
                NonFiniteData, stacklevel=6)
        if m.checks is None and ds.read.verify_checksums:
            warnings.warn(f"streamwin: {source.url} was packed without chunk checksums (by an older streamwin): "
                          "its bytes are read unverified; repack it, or run `streamwin index` on it, to add them",
                          RuntimeWarning, stacklevel=6)
