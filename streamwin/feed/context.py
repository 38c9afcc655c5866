"""How a loader's worker processes start: the start method (fork where it can), its context, how many by default."""
from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any


def default_start_method() -> str | None:
    """fork where the platform has it (no re-import of the user's script), else Python's default."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() and sys.platform != "darwin" else None


FORKSERVER_PRELOAD = ("torch", "streamwin.feed.worker")


def start_context(method: Any) -> multiprocessing.context.BaseContext:
    """The context of a start method (a name, or a context object as DataLoader takes); for forkserver, one
    whose server imports torch and streamwin before it forks any worker, so a worker starts in milliseconds
    instead of importing them. The preload list is per process and read when its server starts: a server
    already running (started without it) is used as it is. An unknown name is a ValueError listing the known."""
    if isinstance(method, multiprocessing.context.BaseContext):
        ctx = method
    elif method is None or isinstance(method, str) and method in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context(method)
    else:
        raise ValueError(f"multiprocessing_context must be one of {multiprocessing.get_all_start_methods()} or a "
                         f"multiprocessing context object, got {method!r}")
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        # multiprocessing has no public getter of the preload list: read it to keep a user's own entries
        server = getattr(forkserver, "_forkserver", None)
        preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
        missing = [m for m in FORKSERVER_PRELOAD if m not in preload]
        if missing:
            ctx.set_forkserver_preload(preload + missing)
    return ctx


def default_workers(context: Any = None) -> int:
    """1 worker process when a core is free for it and workers can fork, else 0 (in-process)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    if isinstance(context, multiprocessing.context.BaseContext):
        context = context.get_start_method()
    method = context or default_start_method()
    return 1 if cores >= 2 and method == "fork" else 0
