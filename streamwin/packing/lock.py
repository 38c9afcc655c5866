"""The pack locks: one writer at a time commits to a destination; parts exclude whole packs; the dead are taken over.

A pack, a merge and an index (the verbs that commit index.json) create ``.streamwin-pack.lock``
at the dataset root before they touch anything there; ``pack --part i/n`` creates its own
``.streamwin-pack.partIIIII-of-NNNNN.lock`` instead, so the parts of one job run at once. Each
create is exclusive, decided by the store itself (`urls.create_exclusive`: a hard link on a
local disk, ``If-None-Match: *`` on s3 and azure, ``ifGenerationMatch=0`` on gcs), so of two
creating one lock exactly one gets it; the other stops at once with a PackError naming the
destination and the holder. A part and a whole pack exclude each other by creating their own
lock first and then looking for the other's (`exclude_parts`, `yield_to_pack`): whatever the
order, at least one sees the other, and the part gives way.

A lock says who holds it (host, pid and its start time, a random token), which generation of
shards the holder writes, and when it last showed a sign of life: a thread rewrites it every
HEARTBEAT_S seconds. A lock whose holder is gone is stale: at once when the holder ran on this
machine and its process is dead, else STALE_S seconds after its last heartbeat. Taking a stale
lock over is itself exclusive: the taker first creates ``<lock>.takeover-<token>`` (token: the
dead holder's), so exactly one pack succeeds a dead one; it checks that the lock still holds
that token and only then writes its own. A taker that dies midway leaves its claim, which the
next taker succeeds the same way. Before it commits, a pack checks that its lock is still its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
import uuid

from streamwin.errors import PackError
from streamwin.storage.urls import TEMP_MARK, create_exclusive, join, remove_if_exists, write_atomic

LOCK_NAME = ".streamwin-pack.lock"
PART_LOCK = re.compile(r"\.streamwin-pack\.part(\d{5})-of-(\d{5})\.lock")
CLAIM = re.compile(r"(\.streamwin-pack(?:\.part\d{5}-of-\d{5})?\.lock)\.takeover-([0-9a-f]{32})")
HEARTBEAT_S = 15.0  # the holder rewrites its lock this often
STALE_S = 120.0  # a lock not rewritten for this long (another machine's) is taken over
PART_WAIT_S = 2.0  # a pack waits this long for parts that are giving way to it
_TOKEN = re.compile(r"[0-9a-f]{32}")


def part_lock_name(i: int, n: int) -> str:
    """The lock of ``pack --part i/n``: ``.streamwin-pack.partIIIII-of-NNNNN.lock``."""
    return f".streamwin-pack.part{i:05d}-of-{n:05d}.lock"


def is_lock_file(name: str) -> bool:
    """Whether ``name`` is a lock, a part lock or a takeover claim."""
    return name == LOCK_NAME or bool(PART_LOCK.fullmatch(name) or CLAIM.fullmatch(name))


class PackLock:
    """One lock at ``root`` (see the module docstring); a context manager."""

    def __init__(self, fs, root: str, dest: str, what: str = "pack", name: str = LOCK_NAME):
        self.fs, self.root, self.path, self.dest, self.what = fs, root, join(root, name), dest, what
        self.name = name
        self.token = uuid.uuid4().hex
        self.gen = 0
        self.stale_gen = 0  # the generation a dead holder was writing (its files are leftovers)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _content(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": _started(os.getpid()),
                           "token": self.token, "what": self.what, "gen": self.gen, "beat": time.time()}).encode()

    def acquire(self) -> "PackLock":
        """Take the lock (succeeding a dead holder), or PackError naming the destination and the holder."""
        rival = None
        for attempt in range(40):
            if create_exclusive(self.fs, self.path, self._content()):
                break
            holder = read_lock(self.fs, self.path)
            if holder is None:
                continue  # released meanwhile
            if not stale(holder):
                raise PackError(self.busy(holder))
            self.stale_gen = max(self.stale_gen, _gen(holder))
            won, rival = self._succeed(holder, take=True)
            if won:
                break
            time.sleep(0.01 * (1 + attempt % 5))  # another pack is taking it over: see who won
        else:
            raise PackError(self.busy(rival or {}, taking=True))
        self._clean_own_litter()
        self._beat = threading.Thread(target=self._heartbeat, name="streamwin-pack-lock", daemon=True)
        self._beat.start()
        return self

    def _succeed(self, dead: dict, take: bool) -> tuple[bool, dict | None]:
        """Become the one successor of the dead holder ``dead`` (claim its token exclusively, succeeding a claimant
        that died too), then write our lock (``take``) or remove it, if it still holds that token.
        (won, the live rival when another pack is succeeding it)."""
        chain, target = [], dead["token"]
        for _ in range(16):
            claim = f"{self.path}.takeover-{target}"
            if create_exclusive(self.fs, claim, self._content()):
                chain.append(claim)
                break
            claimant = read_lock(self.fs, claim)
            if claimant is None:
                continue  # a successor finished meanwhile: claim again, then find the lock changed
            if not stale(claimant):
                return False, claimant
            chain.append(claim)  # that claimant died midway: succeed it
            target = claimant["token"]
        else:
            return False, None
        now = read_lock(self.fs, self.path)
        won = now is not None and now["token"] == dead["token"]
        if won and take:
            write_atomic(self.fs, self.path, self._content())
        elif won:
            remove_if_exists(self.fs, self.path)
        for claim in reversed(chain):  # the lock no longer holds these tokens: their claims are spent
            remove_if_exists(self.fs, claim)
        return won, None

    def remove_stale(self, holder: dict) -> bool:
        """Remove this lock for its dead ``holder`` (exclusively, as a takeover); False if another pack got it."""
        return self._succeed(holder, take=False)[0]

    def _clean_own_litter(self) -> None:
        """Remove claims on tokens this lock no longer holds, and temporary files of its writes left by dead packs."""
        self.fs.invalidate_cache(self.root)
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return
        for name in names:
            m = CLAIM.fullmatch(name)
            spent = m and m.group(1) == self.name and m.group(2) != self.token
            if spent or (name.startswith(self.name + TEMP_MARK) and abandoned_temp(self.fs, join(self.root, name))):
                remove_if_exists(self.fs, join(self.root, name))

    def busy(self, holder: dict, taking: bool = False) -> str:
        """Why this lock cannot be had: the destination and the holder."""
        age = time.time() - _float(holder.get("beat"))
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, last seen {age:.0f} s ago" if holder
               else "a pack that is not known")
        if taking:
            return (f"cannot lock {self.dest}: its stale lock is being taken over by another pack ({who}); "
                    f"retry when it is done ({join(self.dest, self.name)})")
        return (f"{self.dest} is locked by another {holder.get('what', 'pack')} ({who}): two packs cannot commit to "
                f"one destination. Wait for it to finish; a pack that died is taken over at once on its own machine, "
                f"or {STALE_S:.0f} s after its last sign of life elsewhere ({join(self.dest, self.name)})")

    def set_generation(self, gen: int) -> None:
        """Record the generation of shards this pack writes (a pack that takes over learns it)."""
        self.gen = gen
        write_atomic(self.fs, self.path, self._content())  # a reader never sees half a lock

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.holds():
                return  # taken over: never overwrite another pack's lock
            try:
                write_atomic(self.fs, self.path, self._content())
            except Exception:  # a storage hiccup: the next beat tries again
                pass

    def holds(self) -> bool:
        """Whether the lock is still this pack's."""
        try:
            holder = read_lock(self.fs, self.path)
        except Exception:
            return False
        return holder is not None and holder["token"] == self.token

    def check(self) -> None:
        """PackError unless the lock is still this pack's (a pack that lost it must not commit)."""
        if not self.holds():
            raise PackError(f"this {self.what} lost its lock on {self.dest} (it was taken over as stale, or removed): "
                            "it does not commit; the dataset there is left as it was")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this pack's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        try:
            if self.holds():
                remove_if_exists(self.fs, self.path)
        except Exception:  # leaving a lock behind is safe: it goes stale
            pass

    def __enter__(self) -> "PackLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def read_lock(fs, path: str) -> dict | None:
    """A lock's content (with a ``token`` always: a lock not written whole by pack gets its bytes' hash), or None
    when it is gone."""
    raw = b""
    for attempt in range(3):
        try:
            raw = fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:  # locks are written whole: look again, then call it dead
            time.sleep(0.05 * (attempt + 1))
            continue
        if isinstance(doc, dict) and isinstance(doc.get("token"), str) and _TOKEN.fullmatch(doc["token"]):
            return doc
        break
    return {"beat": 0, "token": hashlib.sha256(raw).hexdigest()[:32]}


def stale(holder: dict) -> bool:
    """A holder that cannot be alive: its process is gone from this machine (or is another process under its pid),
    or it has not beaten for STALE_S."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, under another user
            return False
        started = _started(pid)
        if started is None or (holder.get("start") is not None and started != holder.get("start")):
            return True  # a zombie, or the pid now belongs to another process
        if pid != os.getpid():
            return False
    return time.time() - _float(holder.get("beat")) > STALE_S


def exclude_parts(fs, root: str, dest: str, lock: PackLock) -> None:
    """Under the main lock: no part may be packing. Parts that see the lock give way (waited for up to PART_WAIT_S);
    a dead part's lock is removed; a live one is a PackError naming it (and the main lock is released)."""
    deadline = time.monotonic() + PART_WAIT_S
    while True:
        live = []
        for name in _names(fs, root):
            if not PART_LOCK.fullmatch(name):
                continue
            path = join(root, name)
            holder = read_lock(fs, path)
            if holder is None:
                continue
            if stale(holder):
                PackLock(fs, root, dest, lock.what, name).remove_stale(holder)
            else:
                live.append((name, holder))
        if not live:
            return
        if time.monotonic() > deadline:
            lock.release()
            name, holder = live[0]
            m = PART_LOCK.fullmatch(name)
            raise PackError(f"{dest} is being packed in parts: part {int(m.group(1))}/{int(m.group(2))} is running "
                            f"(pid {holder.get('pid')} on {holder.get('host')}; {len(live)} part(s) in all). A "
                            f"{lock.what} cannot run beside them: wait for the parts, then `streamwin merge {dest}`")
        time.sleep(0.05)


def yield_to_pack(fs, root: str, dest: str, part_lock: PackLock) -> dict | None:
    """For a part holding its part lock: PackError (the part lock released) while a live pack, merge or index holds
    the main lock; the main lock's content when it is stale (its holder died), else None."""
    holder = read_lock(fs, join(root, LOCK_NAME))
    if holder is None or stale(holder):
        return holder
    part_lock.release()
    raise PackError(part_lock.busy(holder))


def abandoned_temp(fs, path: str) -> bool:
    """Whether the temporary file of a lock's write (local disks only) was left by a dead writer: one is written and
    renamed within milliseconds, so one older than STALE_S is."""
    try:
        return time.time() - os.stat(path).st_mtime > STALE_S
    except OSError:
        return False


def _names(fs, root: str) -> list[str]:
    fs.invalidate_cache(root)
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    except FileNotFoundError:
        return []


def _gen(holder: dict) -> int:
    gen = holder.get("gen", 0)
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen >= 0 else 0


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), 0 where that cannot be known; None when it is a
    zombie or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else 0
    except OSError:
        return 0
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])
