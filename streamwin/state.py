"""The loader's position, and the checkpoint that carries it.

A position is a cursor: (epoch, batches this rank has taken in it), plus, after an elastic
resume, the interrupted runs of the epoch (each its plan inputs and the batches taken when it
stopped). Ranks run in lockstep, so every rank's position is the same. A checkpoint is the
position with the plan inputs it was taken under (a few hundred bytes):

    {"version": 2, "epoch": e, "batches": k, "inputs": {...}, "rest_of": [...]}   # rest_of only if any

Loading checks the inputs against the loader's own and names every difference; inputs that
only matter for a position inside an epoch (``POSITION_ONLY``: world, workers, batch size...)
may differ, and then the rest of the epoch is dealt anew (elastic resume). States saved by
streamwin 0.1 (a StatefulDataLoader's, with per-stream cursors) still load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from streamwin.errors import StateMismatchError

STATE_VERSION = 2
# plan inputs that only matter for a position inside an epoch
POSITION_ONLY = frozenset({"batch_size", "world_size", "num_workers", "equalize", "block_windows", "slice_windows"})


@dataclass
class Position:
    """Where a loader is: the epoch, the batches taken in it, and the epoch's interrupted runs (elastic)."""

    epoch: int = 0
    taken: int = 0
    rest: list[dict[str, Any]] = field(default_factory=list)  # {"inputs": plan inputs, "batches": taken then}

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
        if self.rest:
            state["rest_of"] = [dict(r) for r in self.rest]
        return state


def read_state(state: Any) -> tuple[int, int, dict[str, Any], list[dict[str, Any]]]:
    """(epoch, batches taken, plan inputs, interrupted runs) of a state of this version or of the
    StatefulDataLoader era."""
    if isinstance(state, dict) and state.get("version") == STATE_VERSION and "batches" in state:
        rest = state.get("rest_of") or []
        if not isinstance(rest, list) or not all(isinstance(r, dict) and {"inputs", "batches"} <= set(r) for r in rest):
            raise StateMismatchError(f"not a streamwin loader state: rest_of is {str(rest)[:200]}")
        return int(state["epoch"]), int(state["batches"]), state["inputs"], rest
    meta = state.get("streamwin") if isinstance(state, dict) else None
    if isinstance(meta, dict) and meta.get("version") == 1:  # saved by streamwin 0.1 (a StatefulDataLoader)
        streams = list(_stream_states(state))
        taken = sum(int(s["batch"]) for s in streams if s.get("epoch") == meta["epoch"])
        return int(meta["epoch"]), taken, meta["inputs"], []
    check_state(state, {})  # raises, saying what it got
    raise AssertionError("unreachable")


def _stream_states(obj: Any):
    """Every per-stream state inside a StatefulDataLoader state of streamwin 0.1."""
    if isinstance(obj, dict):
        if "stream" in obj and "inputs" in obj and "batch" in obj:
            yield obj
            return
        for v in obj.values():
            yield from _stream_states(v)


def check_state(state: Any, inputs: Mapping[str, Any], *, finished: bool = False) -> None:
    """Refuse a state taken under other plan inputs, naming each difference.

    A state taken after an epoch's last batch (``finished``) carries no position, so only the
    inputs that define the data and its order must agree (not world, workers or batch size).
    """
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
        raise StateMismatchError(f"not a streamwin loader state (version {STATE_VERSION}): {str(state)[:200]}")
    saved = state["inputs"]
    names = sorted(set(saved) | set(inputs))
    if finished:
        names = [k for k in names if k not in POSITION_ONLY]
    diffs = [f"{k}: in checkpoint {saved.get(k)!r} / now {inputs.get(k)!r}" for k in names
             if _planned(k, saved.get(k)) != _planned(k, inputs.get(k))]
    if diffs:
        raise StateMismatchError("cannot resume exactly, the plan inputs differ: " + "; ".join(diffs))


def same_position(saved: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether a position taken under ``saved`` inputs means the same batches under ``now`` (no elastic resume)."""
    return all(_planned(k, saved.get(k)) == _planned(k, now.get(k)) for k in POSITION_ONLY)


def _planned(name: str, value: Any) -> Any:
    """A plan input as the plan uses it: 0 and 1 workers both run one stream per rank (the same plan)."""
    return max(1, value) if name == "num_workers" and isinstance(value, int) else value
