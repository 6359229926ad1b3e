"""A ``TrainState`` as FQN-keyed DCP entries: the views of its shards a rank writes, and the tensors it reads into.

Parameters are ``model.<fqn>`` (every alias of a tied one), buffers ``model.<name>``, optimizer
state ``optim.state.<fqn>.<field>``: each a ``Pieces`` of this rank's elements (no copy), the step
counters one per parameter. Loading targets the same keys, on the tensors of ``like`` (or new ones
where it is on the meta device), its padding zeroed.

Under tensor parallelism the keys and shapes are the whole parameters' (``Placement``): each rank
writes the chunks of its piece of every split parameter, and a parameter the axis does not split
(the same on every rank of it) is written by the axis's first rank only, as DCP would keep one of
identical chunks; every rank reads the chunks its piece overlaps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsdp_fn._plan import ParamSpec, Unit, unit_label
from fsdp_fn._shard import Layout, Sharded
from fsdp_fn._step import TrainState
from fsdp_fn.checkpoint._dcp import Pieces, Placement, whole_shape
from fsdp_fn.checkpoint._opt_state import _opt_fields, _rebuild


def _parts(unit: Unit, layout: Layout, shards: Sharded) -> list[tuple[Unit, torch.Tensor]]:
    out = [(unit, shards[unit.name])]
    if unit.frozen:
        out.extend(zip(unit.frozen_parts, layout.frozen[unit.name], strict=True))
    return out


def _pieces(part: Unit, flat: torch.Tensor, layout: Layout, *, writing: bool = False) -> list[tuple[ParamSpec, Pieces]]:
    """Each parameter of ``part`` with its elements in this rank's shard ``flat``, as DCP chunks of
    the whole parameter. ``writing``: only those this rank writes (not, on a tensor-parallel
    rank but the first, the parameters the axis does not split: its first rank writes them)."""
    tensor = layout.plan.tensor
    skip_whole = writing and layout.tensor_axis is not None and layout.tensor_axis.group.rank() != 0
    out = []
    for i, first, end, at in part.held(layout.world, layout.rank):
        spec = part.params[i]
        if skip_whole and spec.split is None:
            continue
        place = Placement.of(spec, tensor)
        out.append((spec, Pieces(spec.shape, flat[at : at + end - first], first, end, place)))
    return out


def _is_step(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("step", "count")


def _step_views(unit: Unit, steps: torch.Tensor, *, every: bool) -> list[tuple[ParamSpec, torch.Tensor]]:
    """Each trainable parameter's step counter: one per parameter (shape ``(P,)``) or one per
    unit (0-d; ``every``: the unit's counter for each parameter, else for its first only)."""
    if steps.dim() == 0:
        return [(spec, steps) for spec in (unit.params if every else unit.params[:1])]
    return [(spec, steps[i]) for i, spec in enumerate(unit.params)]


def _entries(state: TrainState, *, write_shards: bool, coordinator: bool) -> dict[str, Any]:
    """The FQN-keyed entries this rank contributes: views of its shards (no copy)."""
    params, layout = state.params, state.params.layout
    out: dict[str, Any] = {}
    fields = _opt_fields(state.opt_state)
    for unit in layout.plan.units:
        if write_shards:
            for part, flat in _parts(unit, layout, params):
                for spec, pieces in _pieces(part, flat, layout, writing=True):
                    for name in (spec.name, *spec.aliases):
                        out[f"model.{name}"] = pieces
            for tname, tree in fields:
                if not _is_step(tname):
                    for spec, pieces in _pieces(unit, tree[unit.name], layout, writing=True):
                        out[f"optim.state.{spec.name}.{tname}"] = pieces
        if coordinator:
            for tname, tree in fields:
                if _is_step(tname):
                    for spec, t in _step_views(unit, tree[unit.name], every=True):
                        out[f"optim.state.{spec.name}.{tname}"] = t
    if coordinator:
        for name, b in state.buffers.items():
            out[f"model.{name}"] = b
    return out


def _ready(t: torch.Tensor) -> torch.Tensor:
    """A tensor to load into: ``t`` itself, or a new one where ``t`` is on the meta device."""
    return torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t


def _zero_padding(unit: Unit, flat: torch.Tensor, layout: Layout) -> None:
    start = unit.numel - layout.rank * unit.shard_numel(layout.world)
    if start < flat.numel():
        flat[max(start, 0) :].zero_()


class _Target(NamedTuple):
    state: TrainState
    entries: dict[str, Any]  # what this rank reads, keyed as in the checkpoint
    expected: dict[str, tuple[tuple[int, ...], torch.dtype, str]]  # every rank's keys: shape, dtype, name


def _target(like: TrainState) -> _Target:
    """Tensors to load into (``like``'s, or new ones where it is on the meta device) and their entries."""
    layout = like.params.layout
    frozen = {k: tuple(_ready(t) for t in v) for k, v in layout.frozen.items()}
    if any(a is not b for k, v in layout.frozen.items() for a, b in zip(frozen[k], v, strict=True)):
        layout = layout.with_frozen(frozen)

    def ready(tree: Sharded) -> Sharded:
        return Sharded({k: _ready(v) for k, v in tree.shards.items()}, layout)

    params = ready(like.params)
    opt_state = _rebuild(like.opt_state, {id(v): ready(v) for _, v in _opt_fields(like.opt_state)}, {})
    buffers = {k: _ready(v) for k, v in like.buffers.items()}
    entries: dict[str, Any] = {}
    expected: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {}
    for unit in layout.plan.units:
        for part, flat in _parts(unit, layout, params):
            for spec in part.params:
                what = f"parameter {spec.name!r} ({_where(unit)})"
                expected[f"model.{spec.name}"] = (whole_shape(spec), spec.dtype, what)
            _zero_padding(part, flat, layout)
            for spec, pieces in _pieces(part, flat, layout):
                entries[f"model.{spec.name}"] = pieces
        for tname, tree in _opt_fields(opt_state):
            t = tree[unit.name]
            for spec in unit.params:
                what = f"optimizer state {tname!r} of {spec.name!r} ({_where(unit)})"
                shape = () if _is_step(tname) else whole_shape(spec)
                expected[f"optim.state.{spec.name}.{tname}"] = (shape, t.dtype, what)
            if _is_step(tname):
                for spec, view in _step_views(unit, t, every=False):
                    entries[f"optim.state.{spec.name}.{tname}"] = view
            else:
                _zero_padding(unit, t, layout)
                for spec, pieces in _pieces(unit, t, layout):
                    entries[f"optim.state.{spec.name}.{tname}"] = pieces
    for name, b in buffers.items():
        entries[f"model.{name}"] = b
        expected[f"model.{name}"] = (tuple(b.shape), b.dtype, f"buffer {name!r}")
    state = TrainState(params, opt_state, buffers, like.step)
    return _Target(state, entries, expected)


def _where(unit: Unit) -> str:
    return f"unit {unit_label(unit.name)}"
