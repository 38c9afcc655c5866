"""A job with a transform always stops: Ctrl-C at any moment of start-up, a transform that hangs (issue 43: 9, 11).

Real worker processes, real signals: a child interpreter builds loaders and iterates them, and is sent
SIGINT (to its whole process group, as a terminal's Ctrl-C) after a random delay, many times over;
each run must end promptly with KeyboardInterrupt as its only traceback, leaving no process and
nothing in /dev/shm.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import streamwin as sw
from conftest import make_sequences, our_children
from streamwin.feed.slots import leftovers

HERE = os.path.dirname(os.path.dirname(os.path.abspath(sw.__file__)))  # the child imports this streamwin

# Imports once, then forks a job a line of stdin ("<stderr file>"): each job, in its own process group (its workers
# too), builds loaders and iterates them; the zygote prints the job's pid, then its wait status once it ends.
ZYGOTE = """
import os
import signal
import sys
import numpy as np
import streamwin as sw
from streamwin.loader import WindowLoader

def scale(batch, rng):
    return {"x": batch["x"] * 2 + rng.standard_normal(batch["x"].shape, dtype=np.float32)}

for line in sys.stdin:
    # SIGINT waits while the fork runs its hooks in the job (CPython's, filelock's): one raised in a hook is printed
    # as "Exception ignored" and lost, a job started from a shell never meets; it arrives once they have run
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = os.fork()
    if pid == 0:  # the job: an uncaught KeyboardInterrupt ends it as it ends a script
        os.setpgid(0, 0)
        fd = os.open(line.strip(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        ds = sw.WindowDataset(sys.argv[1], window=16, stride=8, batch_size=32)
        while True:  # a new loader each epoch: start-up and close, over and over
            loader = WindowLoader(ds, num_workers=2, transform=scale)
            for b in loader:
                pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        os.setpgid(pid, pid)  # as the job does: its group exists once its pid is printed
    except OSError:
        pass
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("stops") / "ds")
    sw.pack(list(make_sequences(30, max_len=200).items()), url, progress=False)
    return url


def group_of(pgid: int) -> list[psutil.Process]:
    """Live processes of process group ``pgid`` (a child's workers are in its group)."""
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return out


def test_ctrl_c_at_any_moment_of_start_up_stops_the_job_cleanly(tmp_path, url):
    script = tmp_path / "zygote.py"
    script.write_text(ZYGOTE)
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    zygote = subprocess.Popen([sys.executable, str(script), url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    rng = np.random.default_rng(43)
    t0, runs = time.monotonic(), 0
    try:
        while runs < 40 and (runs < 20 or time.monotonic() - t0 < 45):
            err = tmp_path / f"stderr{runs}.txt"
            zygote.stdin.write(f"{err}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            delay = float(rng.uniform(0.0, 0.5))
            time.sleep(delay)
            os.killpg(pid, signal.SIGINT)  # a terminal's Ctrl-C: the job and its workers
            status = wait_line(zygote, 15)
            if status is None:
                os.killpg(pid, signal.SIGKILL)
                pytest.fail(f"run {runs}: Ctrl-C {delay:.3f} s into the job did not stop it within 15 s (lost?); its "
                            f"stderr:\n{err.read_text()[-3000:]}")
            text = err.read_text()
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, \
                f"run {runs} ({delay:.3f} s): ended with status {status}, not by the KeyboardInterrupt:\n{text[-3000:]}"
            assert text.count("Traceback") == 1 and text.rstrip().endswith("KeyboardInterrupt"), \
                f"run {runs} ({delay:.3f} s): not one KeyboardInterrupt alone:\n{text[-3000:]}"
            assert "Exception ignored" not in text and "During handling" not in text and "direct cause" not in text, \
                f"run {runs} ({delay:.3f} s): another error beside the KeyboardInterrupt:\n{text[-3000:]}"
            deadline = time.monotonic() + 5
            while group_of(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not group_of(pid), f"run {runs} ({delay:.3f} s): processes left: {group_of(pid)}"
            assert not leftovers(pid)
            runs += 1
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
    assert runs >= 20


def wait_line(proc, timeout: float) -> int | None:
    """The next line of ``proc``'s stdout as an int, or None if none came within ``timeout`` s."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return int(proc.stdout.readline()) if ready else None


def hangs_on_data(batch, rng):
    """Returns on the probe's zeros; sleeps for ever on a real batch (as a transform stuck in a lock or a read)."""
    if batch["x"].any():
        time.sleep(3600)
    return {"x": batch["x"]}


def hangs_always(batch, rng):
    time.sleep(3600)
    return {"x": batch["x"]}


def test_a_transform_that_hangs_in_a_worker_is_named_with_its_stack_and_raised_after_the_timeout(url):
    from streamwin.errors import WorkerError

    ds = sw.WindowDataset(url, window=16, stride=8, batch_size=8, shuffle_buffer=32)
    loader = sw.WindowLoader(ds, num_workers=2, transform=hangs_on_data, timeout=2.0)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"(?s)worker \d \(pid \d+\) has sent no batch for 1 s; it is alive, its "
                                            r"main thread at:\n.*in hangs_on_data\n\s+time.sleep\(3600\).*raises at "
                                            r"timeout=2 s"):
        with pytest.raises(WorkerError, match=r"(?s)worker \d \(pid \d+\) sent no batch for 2 s \(WindowLoader\("
                                              r"timeout=2\)\); it is alive, its main thread at:\n.*in hangs_on_data"):
            for _ in loader:
                pass
    assert time.monotonic() - t0 < 10
    loader.close()
    assert not our_children() and not leftovers(os.getpid())


def test_a_transform_that_hangs_on_the_probe_does_not_block_the_constructor(url):
    ds = sw.WindowDataset(url, window=16, stride=8, batch_size=8)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"(?s)transform hangs_always has not returned for 0.5 s on a batch of "
                                            r"zeros .*in hangs_always\n\s+time.sleep\(3600\)"):
        with pytest.raises(TimeoutError, match=r"(?s)transform hangs_always did not return within timeout=1 s on a "
                                               r"batch of zeros .*in hangs_always"):
            sw.WindowLoader(ds, num_workers=2, transform=hangs_always, timeout=1.0)
    assert time.monotonic() - t0 < 5
    assert not our_children()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "10", True])
def test_timeout_is_seconds_or_none(url, bad):
    ds = sw.WindowDataset(url, window=16, stride=8, batch_size=8)
    with pytest.raises(ValueError, match=r"timeout must be None \(wait for ever\) or seconds > 0, got"):
        sw.WindowLoader(ds, num_workers=0, timeout=bad)


FINALIZER_HIT = """
import os, signal, sys, time
import streamwin as sw

class Dropped:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while garbage collection runs a finalizer
        for _ in range(10_000):  # Python code: the handler runs here, inside the finalizer
            pass

loader = sw.WindowLoader(sw.WindowDataset(sys.argv[1], window=16, stride=8, batch_size=8), num_workers=2)
it = iter(loader)
next(it)
d = Dropped()
del d
for _ in range(500):
    time.sleep(0.01)
print("ran on", flush=True)
"""


def test_ctrl_c_while_a_finalizer_runs_stops_the_job(tmp_path, url):
    """Before: Python prints "Exception ignored in: <function Dropped.__del__>" with the KeyboardInterrupt and the
    job runs on. While a loader is open, the Ctrl-C is delivered again once the finalizer has returned."""
    script = tmp_path / "finalizer.py"
    script.write_text(FINALIZER_HIT)
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, str(script), url], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "ran on" not in r.stdout, r.stderr[-3000:]
    assert r.stderr.count("Traceback") == 1 and r.stderr.rstrip().endswith("KeyboardInterrupt"), r.stderr[-3000:]
    assert "Exception ignored" not in r.stderr, r.stderr[-3000:]


def test_the_default_handler_is_given_back_once_no_loader_is_open(url):
    import gc

    gc.collect()  # the loaders of the tests before, dropped: closed by their finalizers, which keep the handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    loader = sw.WindowLoader(sw.WindowDataset(url, window=16, stride=8, batch_size=8))
    it = iter(loader)
    next(it)
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # ours while it is open
    loader.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    mine = lambda signum, frame: None  # noqa: E731 - a handler of the user's own is left alone
    signal.signal(signal.SIGINT, mine)
    try:
        loader = sw.WindowLoader(sw.WindowDataset(url, window=16, stride=8, batch_size=8))
        next(iter(loader))
        assert signal.getsignal(signal.SIGINT) is mine
        loader.close()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_loader_closed_in_a_finalizer_keeps_the_handler_that_delivers_ctrl_c_again(url):
    """Before: a loader closed by garbage collection gave Python's handler back from inside its ``__del__``, where
    a SIGINT pending meanwhile met it and was lost ("Exception ignored in: WindowLoader.__del__")."""
    from streamwin.feed import stopping

    loader = sw.WindowLoader(sw.WindowDataset(url, window=16, stride=8, batch_size=8))
    next(iter(loader))

    class Closer:
        def __del__(self):
            loader.close()
    closer = Closer()
    del closer
    assert signal.getsignal(signal.SIGINT) is stopping._interrupt  # not given back inside the finalizer
    another = sw.WindowLoader(sw.WindowDataset(url, window=16, stride=8, batch_size=8))
    next(iter(another))
    another.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back outside one
