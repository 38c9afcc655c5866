"""One benchmark case in a fresh child process: the last JSON line it prints, its wall time, the
cores other processes of the machine used meanwhile (what a timing competed with on a shared
machine), and, when asked, the peak RSS and PSS of its process tree.

Every benchmark that runs its cases as children (throughput, memory, gpu_feed, peers, pretrain)
runs them through `run_child`, so a child that crashes, hangs or leaves workers behind is handled
one way: the child gets a session of its own, and on a time-out that session is killed whole.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class TreeSampler:
    """Samples RSS and PSS summed over a process and all its descendants, keeping the peaks."""

    pid: int
    interval: float = 0.1
    peak_rss: int = 0
    peak_pss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "TreeSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        import psutil  # noqa: PLC0415

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            rss = pss = 0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                break
            for proc in procs:
                try:
                    info = proc.memory_full_info()
                except psutil.Error:
                    continue
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self._stop.wait(self.interval)


def busy_cpu_seconds() -> dict[str, float]:
    """CPU seconds the whole machine was busy (steal included), and those this process and
    its reaped descendants used; their difference over a run is what others took."""
    import psutil  # noqa: PLC0415

    t = psutil.cpu_times()
    busy = sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return {"busy": busy, "own": own}


def parse_record(stdout: str) -> dict[str, Any] | None:
    """The last JSON object line a child printed, or None."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


@dataclass
class ChildResult:
    """What one child run gave: its record (None when it printed none or failed) and how it ran."""

    record: dict[str, Any] | None
    returncode: int
    stderr: str
    wall_s: float
    other_cpu_cores: float
    peak_rss_mb: float = 0.0
    peak_pss_mb: float = 0.0

    def failed(self, tail: int = 2000) -> dict[str, Any]:
        """The record of a failed run: its exit code and the tail of its stderr."""
        return {"error": f"exit {self.returncode}", "stderr_tail": self.stderr[-tail:]}


def run_child(cmd: Sequence[str], timeout: float, *, cwd: str, env: dict[str, str] | None = None,
              sample_memory: bool = False) -> ChildResult:
    """Run ``cmd`` in a session of its own (killed whole on time-out); its last JSON line and how it ran."""
    cpu_before, wall_before = busy_cpu_seconds(), time.perf_counter()
    child = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                             start_new_session=True)
    sampler = TreeSampler(child.pid).start() if sample_memory else None
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child's own session: it and its workers only
        stdout, stderr = child.communicate()
        stderr += f"\ntimed out after {timeout:.0f}s"
    finally:
        if sampler is not None:
            sampler.stop()
    wall = time.perf_counter() - wall_before
    cpu_after = busy_cpu_seconds()
    others = (cpu_after["busy"] - cpu_before["busy"]) - (cpu_after["own"] - cpu_before["own"])
    record = parse_record(stdout) if child.returncode == 0 else None
    return ChildResult(record, child.returncode, stderr, wall, max(0.0, others) / max(wall, 1e-9),
                       sampler.peak_rss / 1e6 if sampler else 0.0, sampler.peak_pss / 1e6 if sampler else 0.0)
