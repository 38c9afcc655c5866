"""The loader's position, and the checkpoint that carries it.

A position is a cursor: (epoch, batches this rank has taken in it), plus, after an elastic
resume, the interrupted runs of the epoch (each its plan inputs and the batches taken when it
stopped). Ranks run in lockstep, so every rank's position is the same. A checkpoint is the
position with the plan inputs it was taken under (a few hundred bytes):

    {"version": 2, "epoch": e, "batches": k, "inputs": {...}, "rest_of": [...],   # rest_of only if any
     "check": {"position": d, "inputs": d, "rest_of": [d, ...]}}

Loading checks every field first (``read_state``: types, ranges, sizes; a hand-edited or
damaged state is one StateMismatchError naming the field, never a coerced value or a raw
KeyError), then the fields against each other (a world size that does not divide the
canonical rank slots, runs of one epoch over other data), then the ``check``: a digest of
each part (position, inputs, each interrupted run) saved with it, so that an edit that leaves
a state plausible (``rest_of[0].inputs.canonical`` from [8, 1] to [8, 7]) is refused naming
the part, not resumed under a plan it was never taken under (a state without a check, from an
older streamwin, loads without it). Then the inputs against the loader's own, naming every difference; inputs that
only matter for a position inside an epoch (``POSITION_ONLY``: world, workers, batch size...)
may differ, and then the rest of the epoch is dealt anew (elastic resume). A dataset that grew
since the state was saved (appends, formats/growth.py) is the same ``dataset`` (its first
view's digest) in another ``view``: the state's epoch goes on over the view it was planned on
(``pin``), exactly in the world it was taken in, dealt anew in another; the next epoch plans
over the grown dataset. States saved by streamwin 0.1 (a StatefulDataLoader's, with per-stream
cursors) still load.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from streamwin.errors import StateMismatchError

STATE_VERSION = 2
# plan inputs that only matter for a position inside an epoch
POSITION_ONLY = frozenset({"batch_size", "world_size", "num_workers", "equalize", "block_windows", "slice_windows",
                           "packing", "canonical", "view"})


@dataclass
class Position:
    """Where a loader is: the epoch, the batches taken in it, and the epoch's interrupted runs (elastic)."""

    epoch: int = 0
    counted: int = 0  # batches handed out, and those of the live run not yet (``at_hand``)
    rest: list[dict[str, Any]] = field(default_factory=list)  # {"inputs": plan inputs, "batches": taken then}
    at_hand: Callable[[], int] | None = None  # the live run's batches not yet handed out (its iterator's count)

    @property
    def taken(self) -> int:
        """Batches of the epoch handed out: those counted, less the live run's still at hand."""
        return self.counted - self.at_hand() if self.at_hand is not None else self.counted

    @taken.setter
    def taken(self, batches: int) -> None:
        self.counted, self.at_hand = batches, None

    def settle(self) -> None:
        """No live run any more: its batches not handed out are not taken."""
        self.taken = self.taken

    @property
    def offset(self) -> int:
        """Batches of the epoch taken before this job's plan began (after an elastic resume), else 0."""
        return int(self.rest[-1]["batches"]) if self.rest else 0

    def restart(self) -> None:
        """Back to the start of the epoch, under this world's own plan."""
        self.taken, self.rest = 0, []

    def to_state(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint of this position taken under plan ``inputs``."""
        state = {"version": STATE_VERSION, "epoch": self.epoch, "batches": self.taken, "inputs": inputs}
        rest = self.rest[1:] if self.rest and _pinned_here(self.rest, inputs) else self.rest
        if rest:
            state["rest_of"] = [dict(r) for r in rest]
        state["check"] = seal(state)
        return state


def pin(inputs: dict[str, Any]) -> dict[str, Any]:
    """The run a state's epoch was planned in, as the first of its interrupted runs, of no batches: it names the
    data its epoch is on (``dataset``, ``view``), so that the epoch goes on over that data even where the dataset
    grew since (formats/growth.py; the plan of a first run of no batches is that run's data planned afresh)."""
    return {"inputs": inputs, "batches": 0}


def _pinned_here(rest: list[dict[str, Any]], inputs: dict[str, Any]) -> bool:
    """Whether ``rest`` starts with a pin that says no more than the runs after it (or, alone, than ``inputs``)."""
    first = rest[0]
    if first["batches"]:
        return False
    if len(rest) > 1:
        return rest[1]["inputs"] == first["inputs"]
    return all(first["inputs"].get(k) == inputs.get(k) for k in ("dataset", "view"))


def read_state(state: Any) -> tuple[int, int, dict[str, Any], list[dict[str, Any]]]:
    """(epoch, batches taken, plan inputs, interrupted runs) of a state of this version or of the
    StatefulDataLoader era, every field checked (StateMismatchError naming the one that is wrong)."""
    if isinstance(state, Mapping) and state.get("version") == STATE_VERSION and "batches" in state:
        _known(state, "state", "")
        runs = _runs(state.get("rest_of") or [])
        batches = _count(state["batches"], "batches")
        if runs and batches < runs[-1]["batches"]:
            raise _bad("batches", batches, f"at least the {runs[-1]['batches']} taken before the last interruption")
        epoch, inputs = _count(state.get("epoch"), "epoch", MAX_EPOCH), check_inputs(state.get("inputs"))
        _consistent(inputs, runs)
        if "check" in state:
            _verify(state)
        return epoch, batches, inputs, runs or [pin(inputs)]
    meta = state.get("streamwin") if isinstance(state, Mapping) else None
    if isinstance(meta, Mapping) and meta.get("version") == 1:  # saved by streamwin 0.1 (a StatefulDataLoader)
        epoch = _count(meta.get("epoch"), "streamwin.epoch", MAX_EPOCH)
        streams = list(_stream_states(state, 0))
        taken = sum(_count(s.get("batch"), "batch of a stream") for s in streams if s.get("epoch") == epoch)
        return epoch, taken, check_inputs(meta.get("inputs"), "streamwin.inputs"), []
    check_state(state, {})  # raises, saying what it got
    raise AssertionError("unreachable")


MAX_EPOCH = 1 << 31
MAX_BATCHES = 1 << 40
MAX_RUNS = 1000  # elastic resumes within one epoch
MAX_STREAMS = 1 << 22  # ranks x workers a plan may deal (the planner scale test: 32,768)
MAX_INPUTS_BYTES = 1 << 16  # a state's plan inputs as JSON (a few hundred bytes in practice)
_DEPTH = 16
_POSITION_RANGES = {"batch_size": (1, 1 << 31), "world_size": (1, 1 << 20), "num_workers": (0, 1 << 12),
                    "block_windows": (1, 1 << 40), "slice_windows": (1, 1 << 40), "packing": (1, 3)}
# what each plan input may hold (WindowDataset.plan_inputs writes them): a state holding anything else, or a
# key of none of them, is damaged (shuffle=1 would compare equal to True, and resume under another plan)
_FLAGS = frozenset({"shuffle", "pad", "jitter"})
_COUNTS = frozenset({"seed", "window", "stride", "horizon", "min_window", "window_multiple", "windows_per_sequence",
                     "pack_length", "epoch_windows"})
_OTHER_INPUTS = frozenset({"equalize", "dataset", "split", "sources", "weights", "where", "canonical", "view"})
_KEYS = {"state": frozenset({"version", "epoch", "batches", "inputs", "rest_of", "check"}),
         "run": frozenset({"inputs", "batches"})}


def _bad(field: str, value: Any, want: str) -> StateMismatchError:
    return StateMismatchError(f"not a usable streamwin loader state: field {field} must be {want}, "
                              f"got {str(value)[:120]!r} ({type(value).__name__})")


def _count(value: Any, field: str, high: int = MAX_BATCHES, low: int = 0) -> int:
    """An int (never a bool, a float or a string) in [low, high)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not low <= value < high:
        raise _bad(field, value, f"an integer of {low}..{high - 1}")
    return int(value)


def _runs(rest: Any) -> list[dict[str, Any]]:
    """The interrupted runs of an elastic resume (``rest_of``), checked."""
    if not isinstance(rest, list) or len(rest) > MAX_RUNS:
        raise _bad("rest_of", rest, f"a list of at most {MAX_RUNS} interrupted runs")
    runs = []
    for j, r in enumerate(rest):
        if not isinstance(r, Mapping) or not {"inputs", "batches"} <= set(r):
            raise _bad(f"rest_of[{j}]", r, 'a dict {"inputs": {...}, "batches": n}')
        _known(r, "run", f"rest_of[{j}].")
        runs.append({"inputs": check_inputs(r["inputs"], f"rest_of[{j}].inputs"),
                     "batches": _count(r["batches"], f"rest_of[{j}].batches")})
    if any(a["batches"] > b["batches"] for a, b in zip(runs, runs[1:])):
        raise _bad("rest_of", [r["batches"] for r in runs], "runs whose batches do not fall")
    return runs


def check_inputs(inputs: Any, field: str = "inputs") -> dict[str, Any]:
    """Plan inputs as a state carries them: a dict of plain JSON values, small, position inputs in range."""
    if not isinstance(inputs, Mapping) or not all(isinstance(k, str) for k in inputs):
        raise _bad(field, inputs, "a dict of plan inputs (string keys)")
    try:
        size = len(json.dumps(inputs, default=_refuse))
    except (TypeError, ValueError, RecursionError) as e:
        raise _bad(field, inputs, f"plain JSON values ({type(e).__name__})") from None
    if size > MAX_INPUTS_BYTES:
        raise _bad(field, f"{size:,} bytes of JSON", f"at most {MAX_INPUTS_BYTES:,} bytes of JSON")
    for name, (low, high) in _POSITION_RANGES.items():
        if name in inputs:
            _count(inputs[name], f"{field}.{name}", high, low)
    for name, value in inputs.items():
        if name in _FLAGS and not isinstance(value, bool):
            raise _bad(f"{field}.{name}", value, "true or false")
        if name in _COUNTS and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                      or value < 0):
            raise _bad(f"{field}.{name}", value, "an integer >= 0")
        if name not in _FLAGS | _COUNTS | _OTHER_INPUTS | set(_POSITION_RANGES):
            raise _bad(f"{field}.{name}", value, "absent: it is no plan input of this streamwin")
    streams = inputs.get("world_size", 1) * max(1, inputs.get("num_workers", 0))
    if streams > MAX_STREAMS:  # a plan keeps a few numbers per stream: 10**9 of them would not fit
        raise _bad(f"{field}.world_size", inputs.get("world_size"), f"at most {MAX_STREAMS:,} streams with its "
                   f"num_workers ({streams:,} would need ~{streams * 64 / 1e9:,.0f} GB to plan)")
    view = inputs.get("view")
    if view is not None and not all(v is None or (isinstance(v, str) and len(v) == 16)
                                    for v in (view if isinstance(view, list) else [view])):
        raise _bad(f"{field}.view", view, "the 16-digit id of a view of the dataset (or a list of them, or null)")
    canonical = inputs.get("canonical")
    if canonical is not None and (not isinstance(canonical, list) or len(canonical) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096 for v in canonical)):
        raise _bad(f"{field}.canonical", canonical, "[rank slots, step phases], two integers of 1..4096")
    if "equalize" in inputs and inputs["equalize"] not in ("drop", "pad"):
        raise _bad(f"{field}.equalize", inputs["equalize"], '"drop" or "pad"')
    if inputs.get("pack_length") is not None and "packing" not in inputs:  # a state without PACKING (plan/options.py)
        return dict(inputs) | {"packing": 1}
    return dict(inputs)


def seal(state: Mapping[str, Any]) -> dict[str, Any]:
    """The ``check`` of a state: a digest of its position, of its inputs and of each interrupted run."""
    out = {"position": _digest([state["epoch"], state["batches"]]), "inputs": _digest(state["inputs"])}
    if state.get("rest_of"):
        out["rest_of"] = [_digest(r) for r in state["rest_of"]]
    return out


def _digest(part: Any) -> str:
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), default=lambda v: v.item())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _verify(state: Mapping[str, Any]) -> None:
    """Refuse a state whose parts differ from the digests saved with it (``check``), naming the part."""
    check, want = state["check"], seal(state)
    saved_runs = check.get("rest_of", []) if isinstance(check, Mapping) else None
    if not isinstance(saved_runs, list) or set(check) - {"position", "inputs", "rest_of"} \
            or not all(isinstance(check.get(k), str) for k in ("position", "inputs")):
        raise _bad("check", check, 'the digests streamwin saved with the state, {"position": ..., "inputs": ..., '
                   '"rest_of": [...]}')
    runs = want.get("rest_of", [])
    parts = [("epoch or batches", "position", check["position"], want["position"]),
             ("inputs", "inputs", check["inputs"], want["inputs"])]
    if len(saved_runs) != len(runs):
        parts.append(("rest_of", "rest_of", f"{len(saved_runs)} run(s)", f"{len(runs)} run(s)"))
    parts += [(f"rest_of[{j}]", f"rest_of[{j}]", a, b) for j, (a, b) in enumerate(zip(saved_runs, runs))]
    for name, part, saved, now in parts:
        if saved != now:
            raise StateMismatchError(f"not a usable streamwin loader state: field {name} does not match the check "
                                     f"saved with it (check.{part} is {str(saved)[:40]!r}, the field's digest "
                                     f"{str(now)[:40]!r}): the state was edited or damaged after streamwin saved it")


def _consistent(inputs: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Refuse a state whose fields contradict each other, naming them: a world size or worker count its canonical
    streams cannot serve, or an interrupted run of the epoch over other data, order or windows."""
    for where, given in [("inputs", inputs), *((f"rest_of[{j}].inputs", r["inputs"]) for j, r in enumerate(runs))]:
        canonical = given.get("canonical")
        if canonical is None:
            continue
        slots, phases = canonical
        world, workers = given.get("world_size", 1), given.get("num_workers", 0)
        if slots % world or (phases > 1 and workers and phases % workers):
            name, value, what = ("world_size", world, "rank slots") if slots % world else \
                ("num_workers", workers, "step phases")
            raise StateMismatchError(
                f"not a usable streamwin loader state: fields {where}.{name} ({value}) and {where}.canonical "
                f"({canonical}) contradict each other: each serves whole {what}, and {value} does not divide "
                f"{slots if slots % world else phases}. streamwin never saves such a pair: the state was edited or "
                "damaged")
    for j, run in enumerate(runs):
        for name in sorted((set(run["inputs"]) | set(inputs)) - POSITION_ONLY):
            if _planned(name, run["inputs"].get(name)) != _planned(name, inputs.get(name)):
                raise StateMismatchError(
                    f"not a usable streamwin loader state: field rest_of[{j}].inputs.{name} is "
                    f"{run['inputs'].get(name)!r}, inputs.{name} is {inputs.get(name)!r}: the runs of one epoch share "
                    "their data, order and windows, so the state was edited or damaged")


def _known(obj: Mapping, kind: str, prefix: str) -> None:
    """Refuse a key that no state of this version holds (naming it): a state is checked whole, not skimmed."""
    extra = sorted(set(map(str, obj)) - _KEYS[kind])
    if extra:
        raise _bad(prefix + extra[0], obj[extra[0]] if extra[0] in obj else None, "absent: no key of a loader state")


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


def _stream_states(obj: Any, depth: int):
    """Every per-stream state inside a StatefulDataLoader state of streamwin 0.1 (nested at most _DEPTH deep)."""
    if depth > _DEPTH:
        raise _bad("(a streamwin 0.1 state)", "...", f"nested at most {_DEPTH} levels deep")
    if isinstance(obj, Mapping):
        if "stream" in obj and "inputs" in obj and "batch" in obj:
            yield obj
            return
        for v in obj.values():
            yield from _stream_states(v, depth + 1)


def check_state(state: Any, inputs: Mapping[str, Any], *, finished: bool = False) -> None:
    """Refuse a state taken under other plan inputs, naming each difference.

    A state taken after an epoch's last batch (``finished``) carries no position, so only the
    inputs that define the data and its order must agree (not world, workers or batch size).
    """
    if not isinstance(state, Mapping) or state.get("version") not in (1, STATE_VERSION):
        raise StateMismatchError(f"not a streamwin loader state (version {STATE_VERSION}): {str(state)[:200]}")
    saved = check_inputs(state.get("inputs"))
    names = sorted(set(saved) | set(inputs))
    if finished:
        names = [k for k in names if k not in POSITION_ONLY]
    diffs = [f"{k}: in checkpoint {saved.get(k)!r} / now {inputs.get(k)!r}" for k in names
             if _planned(k, saved.get(k)) != _planned(k, inputs.get(k))]
    if diffs:
        raise StateMismatchError("cannot resume exactly, the plan inputs differ: " + "; ".join(diffs))


# with canonical streams these matter only through the global batch, world_size x batch_size
_WORLD = frozenset({"world_size", "num_workers", "batch_size"})


def same_position(saved: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether a position taken under ``saved`` inputs means the same batches under ``now`` (no elastic resume).

    With canonical streams the position is the global step, the same in any world and worker count,
    so only the global batch (world_size x batch_size) and the order's own inputs must agree.
    """
    names = POSITION_ONLY - {"view"}  # a loaded state's epoch goes on over its own view (``pin``)
    if saved.get("canonical") is not None and saved.get("canonical") == now.get("canonical"):
        if _global_batch(saved) != _global_batch(now):
            return False
        names = names - _WORLD
    return all(_planned(k, saved.get(k)) == _planned(k, now.get(k)) for k in names)


def _global_batch(inputs: Mapping[str, Any]) -> Any:
    return inputs.get("world_size", 1) * inputs.get("batch_size", 0)


def _planned(name: str, value: Any) -> Any:
    """A plan input as the plan uses it: 0 and 1 workers both run one stream per rank (the same plan)."""
    return max(1, value) if name == "num_workers" and isinstance(value, int) else value
