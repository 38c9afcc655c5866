"""How a loader stops: Ctrl-C held while it starts or stops its workers; the loaders left open closed at exit.

Python raises KeyboardInterrupt in whatever Python code runs when SIGINT arrives. Starting and
stopping a worker pool makes and drops processes, pipes, semaphores and threads, whose weakref
callbacks and finalizers run Python code of their own; a KeyboardInterrupt raised in one of them
is printed as "Exception ignored" and lost, and the job runs on. And one raised halfway through
making the pool leaves it half made. So while a loader starts or stops (``held()``), SIGINT only
marks that it came; a wait inside polls ``check()``, which raises it; at the end it is raised, or,
in a finalizer (``__del__``, atexit), where a raise is lost, delivered again to the main thread
once the finalizer has returned. Only the main thread's default handler is replaced: a handler
of the user's own is left alone.

A script may end without ``loader.close()`` (or with a pass abandoned midway): its worker
processes and threads would then be stopped by garbage collection during interpreter
finalization, in whatever order, beside C++ objects (a process group's threads) being destroyed
too; so the loaders left open (``opened``) are closed at exit first, while everything still
stands. They are kept as plain weak references: a WeakSet's callback is Python code run when a
loader dies, where a Ctrl-C would be lost.
"""
from __future__ import annotations

import _thread
import atexit
import signal
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

_state = {"depth": 0, "hit": False}  # scopes open on the main thread; whether SIGINT came within them
_OPEN: dict[int, weakref.ref] = {}  # loaders with a pass or workers running, closed at exit


def _mark(signum, frame) -> None:
    _state["hit"] = True


def check() -> None:
    """Raise KeyboardInterrupt if SIGINT came while held (a wait inside a held scope polls this)."""
    if _state["hit"]:
        _state["hit"] = False
        raise KeyboardInterrupt


@contextmanager
def held(finalizer: bool = False) -> Iterator[None]:
    """SIGINT held while the block runs (see the module docstring); ``finalizer``: the block runs in ``__del__`` or
    at exit, so a SIGINT that came is delivered to the main thread again afterwards instead of raised here."""
    mine = False
    try:
        if threading.current_thread() is threading.main_thread() and \
                (_state["depth"] or signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            if not _state["depth"]:
                signal.signal(signal.SIGINT, _mark)
            _state["depth"] += 1
            mine = True
    except (ValueError, TypeError, AttributeError):  # no signals here (interpreter shutdown, an embedded one)
        pass
    try:
        yield
    finally:
        if mine:
            _state["depth"] -= 1
            if not _state["depth"]:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                if _state["hit"]:
                    _state["hit"] = False
                    if not finalizer:
                        raise KeyboardInterrupt
                    _again()


AGAIN_S = 0.01  # how long after a finalizer held a SIGINT it is delivered again (the finalizer has returned by then)


def _again() -> None:
    """Deliver SIGINT to the main thread again, from a thread of its own, once this finalizer is done."""
    def deliver() -> None:
        time.sleep(AGAIN_S)
        _thread.interrupt_main()
    try:
        threading.Thread(target=deliver, name="streamwin-interrupt", daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down: it is exiting anyway
        pass


def opened(loader: Any) -> None:
    """``loader`` has a pass or workers running: closed at exit unless it is closed (``closed``) before."""
    for key in [k for k, ref in _OPEN.items() if ref() is None]:
        del _OPEN[key]
    _OPEN[id(loader)] = weakref.ref(loader)


def closed(loader: Any) -> None:
    """``loader`` has nothing running any more."""
    _OPEN.pop(id(loader), None)


@atexit.register
def _close_open_loaders() -> None:
    """Close every loader left open, before the interpreter is torn down (a Ctrl-C meanwhile is held)."""
    with held(finalizer=True):
        for ref in list(_OPEN.values()):
            loader = ref()
            try:
                loader is not None and loader.close()
            except Exception:
                pass
