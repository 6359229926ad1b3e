"""An optimizer state as named leaves: torch.optim's names for its sharded fields, its plain values by path.

A checkpoint keys optimizer state as torch does (``optim.state.<fqn>.exp_avg``), so fsdp_fn's
``NamedTuple`` states (``mu``, ``nu``, ``count``, ``trace``) are walked and renamed here, and
rebuilt around the loaded tensors and values.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_fn._shard import Sharded

# torch.optim's names for the fields of fsdp_fn's optimizer states (others keep their field name).
TORCH_NAMES = {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer"}


Path_ = tuple[str, ...]


def _walk(state: Any, path: Path_ = ()) -> list[tuple[Path_, Any]]:
    """The leaves of an optimizer state (NamedTuples and tuples of ``Sharded`` and plain values)."""
    if isinstance(state, Sharded) or state is None:
        return [(path, state)]
    if isinstance(state, torch.optim.Optimizer):
        raise TypeError(
            "checkpoints hold fsdp_fn optimizer states (adamw(), sgd(), chains of them); a from_torch "
            "optimizer keeps its state in the torch object"
        )
    if isinstance(state, tuple):
        names = getattr(state, "_fields", None) or [str(i) for i in range(len(state))]
        return [leaf for name, value in zip(names, state, strict=True) for leaf in _walk(value, (*path, name))]
    if isinstance(state, dict):  # multi_transform's states by label, inject_hyperparams' values
        return [leaf for name, value in state.items() for leaf in _walk(value, (*path, str(name)))]
    return [(path, state)]


def _opt_fields(opt_state: Any) -> list[tuple[str, Sharded]]:
    """(name, Sharded) for each sharded leaf of the optimizer state: torch.optim's name for
    AdamW's and SGD's fields (``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``),
    the field name for others (a chain's accumulated gradients: ``summed``)."""
    leaves = [(path, v) for path, v in _walk(opt_state) if isinstance(v, Sharded)]
    names = [TORCH_NAMES.get(path[-1], path[-1]) for path, _ in leaves]
    if len(set(names)) < len(names):  # two optimizers in one state: keep them apart by path
        names = [".".join(path) for path, _ in leaves]
    return list(zip(names, (v for _, v in leaves), strict=True))


def _opt_values(opt_state: Any) -> dict[str, Any]:
    """The optimizer state's plain values (a chain's counters), by path: saved with the step; and,
    for a tree that marks which parameters got a gradient (``accumulate``'s), their names."""
    out: dict[str, Any] = {}
    for path, v in _walk(opt_state):
        if isinstance(v, Sharded) and v.received is not None:
            reached = [spec.name for u in v.plan.units for spec, got in zip(u.params, v.mask(u), strict=True) if got]
            out[".".join((*path, "received"))] = reached
        elif not isinstance(v, Sharded) and v is not None:
            out[".".join(path)] = v
    return out


def _rebuild(state: Any, sharded: dict[int, Sharded], values: dict[str, Any], path: Path_ = ()) -> Any:
    """``state`` with each ``Sharded`` replaced (by identity) and plain values taken from ``values``."""
    if isinstance(state, Sharded):
        node = sharded[id(state)]
        names = values.get(".".join((*path, "received")))
        if names is None:
            return node
        got = set(names)  # by name: the plan loaded into may group the parameters otherwise
        return node.with_received({u.name: tuple(s.name in got for s in u.params) for u in node.plan.units})
    if state is None:
        return None
    if isinstance(state, tuple):
        names = getattr(state, "_fields", None) or [str(i) for i in range(len(state))]
        items = [_rebuild(v, sharded, values, (*path, n)) for n, v in zip(names, state, strict=True)]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    if isinstance(state, dict):
        return {k: _rebuild(v, sharded, values, (*path, str(k))) for k, v in state.items()}
    return values.get(".".join(path), state)
