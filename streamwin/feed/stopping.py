"""How a loader stops: Ctrl-C held while it starts or stops its workers; the loaders left open closed at exit.

Python raises KeyboardInterrupt in whatever Python code runs when SIGINT arrives. Starting and
stopping a worker pool makes and drops processes, pipes, semaphores and threads, whose weakref
callbacks and finalizers run Python code of their own; a KeyboardInterrupt raised in one of them
is printed as "Exception ignored" and lost, and the job runs on. And one raised halfway through
making the pool leaves it half made. So while a loader starts or stops (``held()``), SIGINT only
marks that it came; a wait inside polls ``check()``, which raises it; at the end it is raised, or,
in a finalizer (``__del__``, atexit), where a raise is lost, delivered again to the main thread
once the finalizer has returned. While a loader is open, a SIGINT that comes while garbage
collection runs a finalizer (a dropped loader's, a pipe's) is delivered again once it has
returned; anywhere else it raises KeyboardInterrupt at once, as Python's handler does. Only the
main thread's default handler is replaced, and given back once no loader is open: a handler of
the user's own is left alone.

A script may end without ``loader.close()`` (or with a pass abandoned midway): its worker
processes and threads would then be stopped by garbage collection during interpreter
finalization, in whatever order, beside C++ objects (a process group's threads) being destroyed
too; so the loaders left open (``opened``) are closed at exit first, while everything still
stands. They are kept as plain weak references: a WeakSet's callback is Python code run when a
loader dies, where a Ctrl-C would be lost.
"""
from __future__ import annotations

import atexit
import signal
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

_state = {"depth": 0, "hit": False}  # scopes open on the main thread; whether SIGINT came within them
_OPEN: dict[int, weakref.ref] = {}  # loaders with a pass or workers running, closed at exit


def _interrupt(signum: int, frame: Any) -> None:
    """The main thread's SIGINT handler while a loader is open or held: Python's (raise KeyboardInterrupt), except
    that within a held scope it marks that SIGINT came, and within a finalizer (where a raise is lost) it is
    delivered again once the finalizer has returned."""
    if _state["depth"]:
        _state["hit"] = True
    elif _in_finalizer(frame):
        _again()
    else:
        raise KeyboardInterrupt


def _in_finalizer(frame: Any) -> bool:
    """Whether ``frame`` runs inside a finalizer: a ``__del__``, or a weakref or multiprocessing callback (garbage
    collection may run one in any code of the main thread; an exception raised in it is printed and dropped)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code in _FINALIZER_CODES or \
                (code.co_name in ("remove", "_remove") and code.co_filename.endswith(("weakref.py", "_weakrefset.py"))):
            return True
        frame = frame.f_back
    return False


def _finalizer_codes() -> frozenset:
    """The code of the callables that run finalizers: weakref.finalize's and multiprocessing's."""
    import multiprocessing.util

    return frozenset({weakref.finalize.__call__.__code__, multiprocessing.util.Finalize.__call__.__code__})


_FINALIZER_CODES = _finalizer_codes()


def _ours() -> bool:
    """Whether the main thread's SIGINT handler is ours, installing it where it is Python's default (not from
    another thread, nor over a handler of the user's own)."""
    try:
        if threading.current_thread() is not threading.main_thread():
            return signal.getsignal(signal.SIGINT) is _interrupt
        handler = signal.getsignal(signal.SIGINT)
        if handler is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupt)
            return True
        return handler is _interrupt
    except (ValueError, TypeError, AttributeError):  # no signals here (interpreter shutdown, an embedded one)
        return False


def _release() -> None:
    """Give the main thread Python's default SIGINT handler back once no loader is open or held; not from within a
    finalizer (a loader's ``__del__``), where a SIGINT pending meanwhile would meet Python's handler and be lost."""
    try:
        if not _state["depth"] and not any(ref() is not None for ref in _OPEN.values()) and \
                threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is _interrupt and not _in_finalizer(sys._getframe(1)):
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, TypeError, AttributeError):
        pass


def check() -> None:
    """Raise KeyboardInterrupt if SIGINT came while held (a wait inside a held scope polls this)."""
    if _state["hit"]:
        _state["hit"] = False
        raise KeyboardInterrupt


@contextmanager
def held(finalizer: bool = False) -> Iterator[None]:
    """SIGINT held while the block runs (see the module docstring); ``finalizer``: the block runs in ``__del__`` or
    at exit, so a SIGINT that came is delivered to the main thread again afterwards instead of raised here."""
    mine = threading.current_thread() is threading.main_thread() and _ours()
    if mine:
        _state["depth"] += 1
    try:
        yield
    finally:
        if mine:
            _state["depth"] -= 1
            if not _state["depth"]:
                _release()
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
        signal.pthread_kill(main, signal.SIGINT)  # a signal, not interrupt_main: it ends a blocking call too
    main = threading.main_thread().ident
    try:
        threading.Thread(target=deliver, name="streamwin-interrupt", daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down: it is exiting anyway
        pass


def opened(loader: Any) -> None:
    """``loader`` has a pass or workers running: closed at exit unless it is closed (``closed``) before."""
    for key in [k for k, ref in _OPEN.items() if ref() is None]:
        del _OPEN[key]
    _OPEN[id(loader)] = weakref.ref(loader)
    _ours()


def closed(loader: Any) -> None:
    """``loader`` has nothing running any more."""
    _OPEN.pop(id(loader), None)
    _release()


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
