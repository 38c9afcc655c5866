"""One resume harness for every stateful stage: restored from its state after any step, a node goes on exactly."""
from __future__ import annotations

import json
from typing import Any, Callable

from torchdata.nodes import BaseNode


def shape(state: Any) -> Any:
    """The keys (recursively) of a state: what must stay the same at every step."""
    if isinstance(state, dict):
        return {k: shape(v) for k, v in sorted(state.items())}
    return type(state).__name__


def assert_resumes_identically(make_node: Callable[[], BaseNode], summarize: Callable[[Any], Any],
                               shutdown: Callable[[BaseNode], None] = lambda node: node.shutdown()) -> list:
    """Run ``make_node()`` to its end, recording its state before every item; then, for every step k, a fresh
    node reset to the state after k items (through JSON, as a checkpoint travels) must yield exactly the
    uninterrupted node's items from k on, and every state must have the same shape. Returns the items."""
    node = make_node()
    node.reset()
    states, items = [json.loads(json.dumps(node.state_dict()))], []
    for item in node:
        items.append(summarize(item))
        states.append(json.loads(json.dumps(node.state_dict())))
    shutdown(node)
    assert items, "the node yielded nothing: nothing was checked"
    assert all(shape(s) == shape(states[0]) for s in states), "the state's shape changed between steps"
    for k, state in enumerate(states):
        again = make_node()
        again.reset(state)
        rest = [summarize(item) for item in again]
        shutdown(again)
        assert rest == items[k:], f"restored after {k} of {len(items)} items, it went on differently"
    return items
