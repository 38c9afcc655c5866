"""The same ~26 Python calls (attribute and dict lookups, a numpy sum, one torch.from_numpy), timed with
time.thread_time back to back, after a 4 ms sleep and after a 4 ms busy loop: what a per-batch cost
measured around a step that sleeps (benchmarks/gpu_feed.py --models idle) is made of on a given machine.

Usage: python benchmarks/cold_calls.py
"""
import time, numpy as np, torch
class A:
    def __init__(self): self.d = {i: i for i in range(50)}; self.x = 0
    def f(self, i): self.x += self.d[i % 50]; return self.x
objs = [A() for _ in range(30)]
arrs = [np.zeros(64) for _ in range(10)]
def work():
    s = 0
    for o in objs[:20]:
        s += o.f(3)
    for a in arrs[:5]:
        s += int(a.sum())
    t = torch.from_numpy(arrs[0]); s += t.numel()
    return s
for sleep in (0.0, 0.004):
    N = 400; tot = 0.0
    for _ in range(N):
        if sleep: time.sleep(sleep)
        a = time.thread_time(); work(); tot += time.thread_time() - a
    print(f"after sleep {sleep*1e3:.0f} ms: {tot/N*1e6:.1f} us per work()")
N = 400; tot = 0.0
for _ in range(N):
    e = time.perf_counter() + 0.004
    while time.perf_counter() < e: pass
    a = time.thread_time(); work(); tot += time.thread_time() - a
print(f"after a 4 ms busy step: {tot/N*1e6:.1f} us per work()")
