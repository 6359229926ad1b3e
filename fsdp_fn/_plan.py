"""The plan: which parameters form which unit, as one inspectable, serialisable value.

A *unit* is the set of parameters gathered together (one all-gather, one reduce-scatter).
Units are chosen by an auto-wrap policy with the seed's signature
``policy(module, recurse, unwrapped_params, **kwargs) -> bool``; the root unit (named
``""``) holds every parameter no other unit claims.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from fsdp_fn._functional import index_of
from fsdp_fn._group import Role, resolve_axes
from fsdp_fn._tp_plan import TensorPlan

Policy = Callable[..., bool]

ROOT = ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in plan")
    return dtype


def unit_label(name: str) -> str:
    """How a unit is named in messages: its module path, or ``(root)``."""
    return repr(name) if name != ROOT else "(root)"


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a unit: where it lives in the module and in the unit's flat buffer.

    Attributes:
        name: the canonical fully-qualified name (first in ``named_parameters()``).
        shape: the full (unsharded) shape: this tensor-parallel rank's piece of it when ``split`` is set.
        dtype: the parameter's dtype (every parameter of a unit's part has the same):
            floating, or, for a frozen parameter, also an integer or bool one.
        requires_grad: trainable (in the unit's flat buffer) or frozen (in one of its
            frozen parts).
        aliases: other names of the same tensor (tied weights).
        split: under tensor parallelism, ``(dim, length)``: the dimension split over its axis
            and its whole length (``shape`` is then this rank's piece); ``None``: the whole
            parameter on every rank of the axis.
    """

    name: str  # canonical fully-qualified name (first in ``named_parameters()``)
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights)
    split: tuple[int, int] | None = None  # (dimension, its whole length) split over the tensor-parallel axis

    @functools.cached_property
    def numel(self) -> int:
        """Elements of the full parameter: the product of ``shape``."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Unit:
    """Parameters gathered together, as one flat buffer: the parameters in order, then padding.

    One all-gather brings the whole unit; one reduce-scatter takes its gradient back. Each
    rank holds ``shard_numel(world)`` elements of the padded buffer. A tied parameter used
    by modules in different units is a unit of its own, gathered by each.

    Attributes:
        name: the module path; ``ROOT`` for the root unit; a parameter's name for a shared
            tied parameter's own unit.
        params: the trainable parameters, in buffer order (gathered with autograd,
            reduce-scattered).
        frozen: the frozen ones (``requires_grad=False``): one more flat buffer per dtype
            among them (``frozen_parts``: an integer or bool parameter beside floating
            ones), gathered in its own dtype but never reduced, with no optimizer state.
        hooks: the modules whose forward gathers the unit, each its own gather (a shared
            tied parameter's users); empty: the module the unit is named after.
        members: consecutive modules gathered once for all of them (FSDP2's
            ``fully_shard([m1, m2])``, ``Plan.merged``): the first to run gathers, the unit
            stays gathered until the last has run, and its backward spans theirs.
        lookup: the unit is one plain ``nn.Embedding``, whose backward reads the indices
            and not the table, so the table is not gathered again for backward (a hint
            about how the module runs, not part of the layout: not serialised, not
            compared).
    """

    name: str  # module path; ROOT for the root unit; a parameter name for a shared tied parameter
    params: tuple[ParamSpec, ...]
    frozen: tuple[ParamSpec, ...] = ()
    hooks: tuple[str, ...] = ()
    lookup: bool = field(default=False, compare=False)
    members: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules whose forward gathers this unit (or runs inside its one gather: ``members``)."""
        return self.hooks or self.members or (self.name,)

    @property
    def own_module(self) -> bool:
        """Whether the unit is one module's, the one it is named after (not the root, a shared
        parameter's or a group's)."""
        return self.name != ROOT and not self.hooks and not self.members

    @functools.cached_property
    def frozen_parts(self) -> tuple[Unit, ...]:
        """The frozen parameters as units of their own, one per dtype in order of first
        appearance: the layouts of the unit's frozen buffers, each gathered in its own dtype."""
        by_dtype: dict[torch.dtype, list[ParamSpec]] = {}
        for p in self.frozen:
            by_dtype.setdefault(p.dtype, []).append(p)
        return tuple(Unit(self.name, tuple(specs)) for specs in by_dtype.values())

    @functools.cached_property
    def all_params(self) -> tuple[ParamSpec, ...]:
        """The trainable parameters, then the frozen ones."""
        return self.params + self.frozen

    @functools.cached_property
    def numel(self) -> int:
        """Elements of the trainable parameters (the flat buffer without padding)."""
        return sum(p.numel for p in self.params)

    @functools.cached_property
    def dtype(self) -> torch.dtype:
        """The unit's dtype: its trainable parameters', else its first floating frozen one's.

        A unit of integer or bool parameters alone is float32: its trainable shard (and so its
        gradient and optimizer moments) is empty but floating like every other one.
        """
        if self.params:
            return self.params[0].dtype
        return next((p.dtype for p in self.frozen if p.dtype.is_floating_point), torch.float32)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each trainable parameter starts in the flat buffer, in ``params`` order."""
        out, at = [], 0
        for p in self.params:
            out.append(at)
            at += p.numel
        return tuple(out)

    def shard_numel(self, world: int) -> int:
        """Elements each rank holds: ``ceil(numel / world)``.

        Args:
            world: the number of ranks the unit is sharded over.

        Returns:
            The length of one rank's shard.
        """
        return -(-self.numel // world)

    def padded_numel(self, world: int) -> int:
        """Elements of the gathered flat buffer, padding included: ``world * shard_numel(world)``.

        Args:
            world: the number of ranks the unit is sharded over.

        Returns:
            The length of the gathered buffer.
        """
        return self.shard_numel(world) * world

    def held(self, world: int, rank: int) -> tuple[tuple[int, int, int, int], ...]:
        """Which parts of which parameters rank ``rank``'s shard holds, and where.

        The one place the shard arithmetic lives: gathering, checkpoints, export and the
        optimizer's per-parameter steps read it. Computed once per ``(world, rank)``.

        Args:
            world: the number of ranks the unit is sharded over.
            rank: the rank in the shard group, ``0 <= rank < world``.

        Returns:
            ``(i, first, end, at)`` for each parameter ``i`` of ``params`` that the rank
            holds part of: its elements ``[first, end)`` (counted within the parameter) lie
            in the rank's shard from ``at`` on.
        """
        memo: dict[tuple[int, int], tuple[tuple[int, int, int, int], ...]] = self.__dict__.setdefault("_held", {})
        key = (world, rank)
        if key not in memo:
            n = self.shard_numel(world)
            start, out = rank * n, []
            for i, (spec, at) in enumerate(zip(self.params, self.offsets, strict=True)):
                first, end = max(at, start), min(at + spec.numel, start + n)
                if first < end:
                    out.append((i, first - at, end - at, first - start))
            memo[key] = tuple(out)
        return memo[key]

    def local_ranges(self, world: int, rank: int) -> tuple[tuple[int, int, int], ...]:
        """Where each parameter lies in rank ``rank``'s shard: ``(i, lo, hi)`` for every one.

        Args:
            world: the number of ranks the unit is sharded over.
            rank: the rank in the shard group, ``0 <= rank < world``.

        Returns:
            ``(i, lo, hi)`` for every parameter ``i`` of ``params``: the elements
            ``[lo, hi)`` of the rank's shard that hold part of it (``lo == hi`` when the
            rank holds none of it).
        """
        memo: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = self.__dict__.setdefault("_ranges", {})
        key = (world, rank)
        if key not in memo:
            n = self.shard_numel(world)
            held = {i: (at, at + end - first) for i, first, end, at in self.held(world, rank)}
            # (a parameter the rank holds none of: an empty range where it would start or end)
            edge = [min(max(at - rank * n, 0), n) for at in self.offsets]
            memo[key] = tuple((i, *held.get(i, (edge[i], edge[i]))) for i in range(len(self.params)))
        return memo[key]

    def gather_bytes(self, world: int = 1, dtype: torch.dtype | None = None) -> int:
        """Bytes of the gathered flat buffers (padding included, frozen parts too) on one rank.

        Args:
            world: the number of ranks the unit is sharded over (it sets the padding).
            dtype: the dtype its floating buffers are gathered in (mixed precision's
                ``param_dtype``); ``None``: their own. Integer and bool parts keep theirs.

        Returns:
            What one gather of the unit allocates, in bytes.
        """
        total = self.padded_numel(world) * (dtype or self.dtype).itemsize
        for part in self.frozen_parts:
            total += part.gather_bytes(world, dtype if part.dtype.is_floating_point else None)
        return total


@dataclass(frozen=True)
class Plan:
    """Units in module order (root first). A value: compare, print, hash, serialise.

    Every rank must hold the same plan: the step and checkpoints compare fingerprints.

    Attributes:
        units: the units, root first, then in the order their modules first run.
        order: every parameter name of the module (tied aliases included) in
            ``named_parameters(remove_duplicate=False)`` order, so a full state dict can
            follow the module's key order (not part of the layout: not serialised, not
            compared).
        non_persistent: the module's buffers that its ``state_dict`` leaves out
            (``register_buffer(..., persistent=False)``), by name: a checkpoint may lack
            them (not part of the layout: not serialised, not compared).
        tensor: under tensor parallelism, which modules are split over its axis and this
            rank's place on it (``make_plan(tp=...)``); the parameters' shapes are then this
            rank's pieces. ``None``: no tensor parallelism.

    Raises:
        ValueError: if a parameter (or an alias of one) is in two units.
    """

    units: tuple[Unit, ...]
    order: tuple[str, ...] = field(default=(), compare=False)
    non_persistent: frozenset[str] = field(default=frozenset(), compare=False)
    tensor: TensorPlan | None = None

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for u in self.units:
            for p in u.all_params:
                for n in (p.name, *p.aliases):
                    if n in seen:
                        raise ValueError(
                            f"parameter {n!r} is in unit {unit_label(seen[n])} and in unit "
                            f"{unit_label(u.name)}: every parameter belongs to exactly one unit"
                        )
                    seen[n] = u.name

    def unit(self, name: str) -> Unit:
        """The unit named ``name``.

        Args:
            name: a unit's name (``ROOT``, ``""``, for the root unit).

        Returns:
            The ``Unit``.

        Raises:
            KeyError: if the plan has no such unit; the message lists the units.
        """
        found = self._by_name.get(name)
        if found is not None:
            return found
        raise KeyError(f"no unit {unit_label(name)} in the plan; units: {self.unit_names}")

    @functools.cached_property
    def _by_name(self) -> dict[str, Unit]:
        return {u.name: u for u in self.units}

    @functools.cached_property
    def unit_names(self) -> tuple[str, ...]:
        """The units' names, in plan order."""
        return tuple(u.name for u in self.units)

    @functools.cached_property
    def params(self) -> tuple[ParamSpec, ...]:
        """Every parameter, trainable and frozen."""
        return tuple(p for u in self.units for p in u.all_params)

    @functools.cached_property
    def numel(self) -> int:
        """Elements of every parameter, trainable and frozen (no padding)."""
        return sum(p.numel for p in self.params)

    @functools.cached_property
    def _planned(self) -> dict[str, ParamSpec]:
        return {name: spec for spec in self.params for name in (spec.name, *spec.aliases)}

    def unfrozen(self, module: nn.Module) -> frozenset[str]:
        """The parameters the plan holds frozen that ``module`` has made trainable since.

        Args:
            module: the module the plan was made for.

        Returns:
            Their canonical names (empty: nothing was unfrozen). Reads only ``requires_grad`` flags.
        """
        planned = self._planned
        return frozenset(
            planned[name].name
            for name, p in index_of(module).named_parameters()
            if name in planned and p.requires_grad and not planned[name].requires_grad
        )

    def with_trainable(self, names: Iterable[str]) -> Plan:
        """This plan with the frozen parameters ``names`` trainable: each joins its unit's
        trainable part after the parameters it holds already (their places do not move).

        Args:
            names: canonical names of frozen parameters of the plan.

        Returns:
            A new plan with the same units, in the same order.

        Raises:
            ValueError: if a name is not a frozen parameter of the plan, or its dtype is not
                its unit's trainable dtype (a unit's flat buffer holds one dtype).
        """
        names = set(names)
        units = []
        for u in self.units:
            moved = tuple(p for p in u.frozen if p.name in names)
            if not moved:
                units.append(u)
                continue
            for p in moved:
                if u.params and p.dtype != u.params[0].dtype:
                    raise ValueError(
                        f"parameter {p.name!r} of unit {unit_label(u.name)} is trainable now but is {p.dtype}, "
                        f"and the unit's trainable parameters are {u.params[0].dtype}: one flat buffer holds one "
                        "dtype; make a new plan and carry the parameters over"
                    )
            names -= {p.name for p in moved}
            trainable = tuple(dataclasses.replace(p, requires_grad=True) for p in moved)
            units.append(
                dataclasses.replace(u, params=u.params + trainable, frozen=tuple(p for p in u.frozen if p not in moved))
            )
        if names:
            raise ValueError(f"not frozen parameters of the plan: {sorted(names)}")
        return dataclasses.replace(self, units=tuple(units))

    def merged(self, names: Sequence[str]) -> Plan:
        """This plan with the consecutive units ``names`` as one: one all-gather and one
        reduce-scatter for all of them (FSDP2's ``fully_shard([m1, m2])``).

        The merged unit is named ``"first..last"``; its parameters are theirs in order, its
        modules (``members``) theirs, each run inside the one gather: the first to run
        gathers it, the last resharding it after forward. A checkpoint does not see the
        grouping (it keys parameters by name), so one saved under one grouping loads under
        another. Fewer, larger units: fewer round trips and less host work per step, more
        memory gathered at once.

        Args:
            names: two or more unit names, consecutive in the plan (its run order), each a
                module's own unit (not the root, a shared tied parameter's, or a lookup that
                fetches rows), or a merged one.

        Returns:
            A new plan; the other units unchanged.

        Raises:
            ValueError: if fewer than two names are given, a name is not such a unit, the
                units are not consecutive, one's module lies inside another's, or their
                trainable parameters differ in dtype.
        """
        names = list(names)
        if len(names) < 2:
            raise ValueError(f"merging needs two or more units, got {names}")
        at = {u.name: i for i, u in enumerate(self.units)}
        for n in names:
            if n not in at:
                raise ValueError(f"unit {unit_label(n)} is not in the plan (its units: {list(self.unit_names)})")
            u = self.units[at[n]]
            if not (u.own_module or u.members):
                raise ValueError(
                    f"unit {unit_label(n)} cannot be merged: only a module's own units (or merged ones) can be, "
                    "not the root or a tied parameter's unit gathered by several modules"
                )
        first = at[names[0]]
        if [at[n] for n in names] != list(range(first, first + len(names))):
            raise ValueError(f"units {names} are not consecutive in the plan: {list(self.unit_names)}")
        group = self.units[first : first + len(names)]
        members = tuple(m for u in group for m in u.modules)
        for a in members:
            inner = next((b for b in members if b != a and b.startswith(a + ".")), None)
            if inner is not None:
                raise ValueError(f"units {names} cannot be merged: module {inner!r} lies inside {a!r}")
        params = tuple(p for u in group for p in u.params)
        frozen = tuple(p for u in group for p in u.frozen)  # (one frozen part per dtype: any mix)
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"units {names} cannot be merged: their trainable parameters are of several dtypes "
                f"({sorted(map(_dtype_name, dtypes))}); one flat buffer holds one dtype"
            )
        first_name, last_name = group[0].name.split("..")[0], group[-1].name.split("..")[-1]
        unit = Unit(f"{first_name}..{last_name}", params, frozen, members=members)
        return dataclasses.replace(self, units=(*self.units[:first], unit, *self.units[first + len(names) :]))

    def grouped(self, size: int) -> Plan:
        """This plan with every run of ``size`` consecutive mergeable units merged (``merged``):
        blocks ``0..size-1``, ``size..2*size-1``, ... of each run of a module's own units of one
        dtype; the root, tied and lookup units stay as they are.

        Args:
            size: units per merged unit (1: the plan itself).

        Returns:
            A new plan.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        plan, i = self, 0
        while i < len(plan.units):
            run: list[str] = []
            for u in plan.units[i:]:
                if not u.own_module or u.lookup or (run and not _one_dtype_each(plan.unit(run[0]), u)):
                    break
                run.append(u.name)
                if len(run) == size:
                    break
            if len(run) > 1:
                plan = plan.merged(run)
                i += 1
            else:
                i += max(1, len(run))
        return plan

    def check_trainable(self, module: nn.Module) -> frozenset[str]:
        """The trainable parameters of the plan that ``module`` has frozen since the plan was made.

        Steps treat a parameter frozen since (``requires_grad_(False)``) as reaching no
        gradient, so it keeps its value and optimizer state, as torch.optim skips it;
        unfreezing it again trains it again. Reads only ``requires_grad`` flags.

        Args:
            module: the module the plan was made for.

        Returns:
            The canonical names of the plan's trainable parameters that are frozen now.

        Raises:
            ValueError: if a parameter the plan holds frozen is trainable now: it has no
                gradient buffer or optimizer state to train with (``train_unfrozen`` gives it them).
        """
        planned = self._planned
        frozen = set()
        for name, p in index_of(module).named_parameters():
            spec = planned.get(name)
            if spec is None or p.requires_grad == spec.requires_grad:
                continue
            if not p.requires_grad:
                frozen.add(spec.name)
                continue
            raise ValueError(
                f"parameter {name!r} of unit {unit_label(self.unit_of(name).name)} is trainable now "
                "(requires_grad=True) but was frozen when the plan was made: the plan holds it outside the unit's "
                "gradient buffer and optimizer state, so it would not be trained. A train step moves it into "
                "training by itself; here, do it first: params, opt_state = ff.train_unfrozen(params, opt_state, "
                "optimizer, fn.module)"
            )
        return frozenset(frozen)

    def unit_of(self, param: str) -> Unit:
        """The unit that holds parameter ``param``.

        Args:
            param: a parameter's fully-qualified name, or any alias of a tied one.

        Returns:
            The ``Unit`` whose trainable or frozen parameters include it.

        Raises:
            KeyError: if no unit of the plan holds it.
        """
        for u in self.units:
            if any(param == p.name or param in p.aliases for p in u.all_params):
                return u
        raise KeyError(f"parameter {param!r} is in no unit of the plan")

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-able data (``from_dict`` reads it back; ``order`` and ``lookup`` are left out).

        Returns:
            ``{"units": [{"name", "params", "frozen", "hooks"}, ...]}``; each parameter as
            ``{"name", "shape", "dtype", "requires_grad", "aliases"}``.
        """

        def specs(ps: tuple[ParamSpec, ...]) -> list[dict[str, Any]]:
            return [
                {
                    "name": p.name,
                    "shape": list(p.shape),
                    "dtype": _dtype_name(p.dtype),
                    "requires_grad": p.requires_grad,
                    "aliases": list(p.aliases),
                    **({"split": list(p.split)} if p.split is not None else {}),
                }
                for p in ps
            ]

        return {
            **({"tensor": self.tensor.to_dict()} if self.tensor is not None else {}),
            "units": [
                {
                    "name": u.name,
                    "params": specs(u.params),
                    "frozen": specs(u.frozen),
                    "hooks": list(u.hooks),
                    **({"members": list(u.members)} if u.members else {}),
                }
                for u in self.units
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan ``to_dict`` wrote.

        Args:
            data: what ``to_dict`` returned (or its JSON, loaded).

        Returns:
            A ``Plan`` equal to the one written.

        Raises:
            KeyError: if a unit or parameter lacks a field ``to_dict`` writes.
            ValueError: if a dtype is unknown, or a parameter is in two units.
        """

        def specs(ps: list[dict[str, Any]]) -> tuple[ParamSpec, ...]:
            return tuple(
                ParamSpec(
                    p["name"],
                    tuple(p["shape"]),
                    _dtype_from_name(p["dtype"]),
                    p["requires_grad"],
                    tuple(p["aliases"]),
                    tuple(p["split"]) if "split" in p else None,
                )
                for p in ps
            )

        return cls(
            tuple(
                Unit(
                    u["name"],
                    specs(u["params"]),
                    specs(u.get("frozen", [])),
                    tuple(u.get("hooks", [])),
                    members=tuple(u.get("members", [])),
                )
                for u in data["units"]
            ),
            tensor=TensorPlan.from_dict(data["tensor"]) if "tensor" in data else None,
        )

    def to_json(self) -> str:
        """The plan as JSON text (``to_dict``, keys sorted): the same plan gives the same text.

        Returns:
            The JSON text; ``from_json`` reads it back.
        """
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan ``to_json`` wrote.

        Args:
            text: what ``to_json`` returned.

        Returns:
            A ``Plan`` equal to the one written.

        Raises:
            ValueError: if ``text`` is not JSON, a dtype is unknown, or a parameter is in
                two units.
            KeyError: if a unit or parameter lacks a field ``to_json`` writes.
        """
        return cls.from_dict(json.loads(text))

    def fingerprint(self) -> str:
        """A short hash of the whole plan; ranks compare it before they communicate.

        Returns:
            16 hex digits of the SHA-256 of ``to_json()``.
        """
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def unit_fingerprints(self) -> dict[str, str]:
        """A short hash of each unit's layout, so a difference can be named by unit.

        Returns:
            ``{unit name: 16 hex digits}``, in plan order.
        """
        return {u.name: hashlib.sha256(json.dumps(Plan((u,)).to_dict()).encode()).hexdigest()[:16] for u in self.units}

    def __str__(self) -> str:
        rows = [f"Plan: {len(self.units)} units, {self.numel:,} parameters"]
        for u in self.units:
            others = [_dtype_name(p.dtype) for p in u.frozen_parts if p.dtype != u.dtype]
            extra = f"  ({len(u.frozen)} frozen{''.join(f', {d}' for d in others)})" if u.frozen else ""
            extra += f"  gathered by {', '.join(u.hooks)}" if u.hooks else ""
            extra += f"  ({len(u.members)} modules, one gather)" if u.members else ""
            rows.append(
                f"  {unit_label(u.name):<32} {len(u.all_params):>4} params "
                f"{u.numel + sum(p.numel for p in u.frozen):>14,} elements "
                f"{u.gather_bytes():>14,} B gathered  {_dtype_name(u.dtype)}{extra}"
            )
        return "\n".join(rows)


def _one_dtype_each(a: Unit, b: Unit) -> bool:
    """Whether two units' trainable parameters may share a flat buffer (frozen ones always may:
    a part per dtype)."""
    return not a.params or not b.params or a.params[0].dtype == b.params[0].dtype


# --- policies ---------------------------------------------------------------------------


def size_policy(min_num_params: int = int(1e8)) -> Policy:
    """Make a policy: a unit for every module whose not-yet-claimed parameters number ``min_num_params``.

    Like torch's ``size_based_auto_wrap_policy`` (containers whose forward never runs,
    ``nn.ModuleList``/``nn.ModuleDict``, are never units).

    Args:
        min_num_params: the fewest unclaimed parameter elements that make a module a unit.

    Returns:
        ``policy(module, recurse, unwrapped_params, **kwargs) -> bool``, for ``make_plan``.
    """

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int, **kwargs: Any) -> bool:
        if recurse:
            return True
        return unwrapped_params >= min_num_params and _has_forward(module)

    policy.__qualname__ = f"size_policy(min_num_params={min_num_params})"
    return policy


def layer_policy(layer_classes: Iterable[type[nn.Module]]) -> Policy:
    """Make a policy: a unit for every instance of ``layer_classes`` (e.g. each transformer block).

    Args:
        layer_classes: the module classes whose instances become units.

    Returns:
        ``policy(module, recurse, unwrapped_params, **kwargs) -> bool``, for ``make_plan``;
        ``make_plan`` raises if the model has no instance of these classes.

    Raises:
        TypeError: if ``layer_classes`` is empty or holds something that is not an
            ``nn.Module`` subclass.
    """
    classes = tuple(layer_classes)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"layer_policy wants nn.Module subclasses, got {classes!r}")

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int, **kwargs: Any) -> bool:
        return True if recurse else isinstance(module, classes)

    policy.__qualname__ = f"layer_policy({', '.join(c.__name__ for c in classes)})"
    policy.layer_classes = classes  # type: ignore[attr-defined]
    return policy


def _is_lookup(module: nn.Module, path: str, specs: list[ParamSpec]) -> bool:
    """Whether ``module`` is a plain ``nn.Embedding`` whose only parameter is its trainable,
    untied table: ``nn.Embedding.forward`` (not overridden), so its backward reads only the
    indices (autograd saves the table's row count, not the table)."""
    return (
        type(module).forward is nn.Embedding.forward
        and "forward" not in module.__dict__
        and [(s.name, s.requires_grad, s.aliases) for s in specs] == [(f"{path}.weight", True, ())]
    )


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


# --- planning ---------------------------------------------------------------------------


def _ask(policy: Policy, module: nn.Module, path: str, recurse: bool, numel: int) -> bool:
    answer = policy(module, recurse, numel)
    if not isinstance(answer, bool):
        raise TypeError(
            f"policy {getattr(policy, '__qualname__', policy)!r} returned "
            f"{type(answer).__name__} {answer!r} for module {unit_label(path)} "
            f"(recurse={recurse}); it must return a bool"
        )
    return answer


def make_plan(
    module: nn.Module,
    policy: Policy | None = None,
    *,
    split_root: bool | Literal["auto"] = "auto",
    tp: TensorPlan | Mapping[str, str] | None = None,
    mesh: Any = None,
) -> Plan:
    """Split ``module``'s parameters into units chosen by ``policy``.

    Walks the module tree like torch's auto-wrap: ``policy(m, True, n)`` says whether to
    look inside ``m``; after its children, ``policy(m, False, n)`` says whether ``m``
    becomes a unit, ``n`` being its parameters not yet claimed by a unit below it.
    A tied parameter whose users sit in different units becomes a unit of its own, which
    each of them gathers as it runs (gradients from every use are summed). Frozen
    parameters (``requires_grad=False``) form one more flat buffer in their unit per dtype
    among them: an integer or bool parameter (frozen: torch lets no other require grad)
    rides along in its own dtype, gathered, never cast or reduced. No communication, no
    allocation: it reads only shapes.

    Args:
        module: the model (it may be on the meta device).
        policy: ``policy(module, recurse, unwrapped_params, **kwargs) -> bool``
            (``layer_policy``, ``size_policy``, or torch's auto-wrap policies); ``None``:
            no unit but the root.
        split_root: ``True`` shards the root like any other unit: what no unit claims is
            split by owning module (e.g. the embedding and the output head become units of
            their own, gathered only while they run, instead of one root unit gathered for
            the whole step). ``"auto"`` splits the root when it is larger than every other
            unit: held for the whole step, it would set the peak. ``False``: one root unit.
        tp: tensor parallelism: ``{module pattern: style}`` (Hugging Face's
            ``model._tp_plan`` as it is; ``*`` stands for one name of the path) or a
            ``TensorPlan``. Each split parameter's spec then has this rank's piece's shape
            (``ParamSpec.split``: the dimension split and its whole length).
        mesh: with a ``tp`` mapping, the ``DeviceMesh`` whose tensor-parallel axis
            (``"tp"``/``"tensor"``) gives the axis's size and this rank's place on it.

    Returns:
        The ``Plan``: the same on every rank for the same model and policy (under tensor
        parallelism, on every rank of one place of the tensor-parallel axis).

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``, ``policy`` is not callable or
            returns something that is not a bool, a parameter is complex (or not
            floating-point and requires grad), or a unit's trainable parameters would mix
            dtypes.
        ValueError: if an ``nn.Embedding`` has ``max_norm``
            (its forward changes the table in place), the policy chooses a module whose
            forward never runs, a ``layer_policy``'s classes are not in the model, a
            tensor-parallel style does not fit its module (or a tied parameter's users split
            it differently), or ``tp`` is a mapping without a mesh of a tensor-parallel axis.

    Examples:
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> make_plan(m, layer_policy([nn.Linear])).unit_names
        ('0', '1')
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"make_plan wants an nn.Module, got {type(module).__name__}")
    if policy is not None and not callable(policy):
        raise TypeError(
            f"policy must be callable as policy(module, recurse, unwrapped_params), "
            f"got {type(policy).__name__} {policy!r}"
        )
    tensor = _tensor_plan(tp, mesh)
    tensors, names_of = _parameters(module)
    chosen = _chosen_units(module, policy, tensors) if policy is not None else set()
    members, shared = _homes(tensors, names_of, chosen)
    if tensor is not None:
        members = {home: [_split(module, tensor, spec) for spec in specs] for home, specs in members.items()}
    if split_root == "auto":
        # A language model's embedding and head outweigh a block: kept gathered all step they
        # set the peak (bench GPT, W=2: 355.7 MiB; split, 315.4 MiB; docs/memory.md).
        size = {name: sum(spec.numel for spec in specs) for name, specs in members.items()}
        others = [n for name, n in size.items() if name != ROOT]
        split_root = bool(others) and size.get(ROOT, 0) > max(others)
    if split_root:
        _split_root(module, members, shared)
    units = _units_in_order(module, members, shared)
    if tensor is not None:  # a split table's rows are fetched under its own masking, not by the lookup path
        units = [
            dataclasses.replace(u, lookup=False) if any(p.split is not None for p in u.params) else u for u in units
        ]
    return Plan(
        tuple(units),
        order=tuple(name for name, _ in module.named_parameters(remove_duplicate=False)),
        non_persistent=frozenset(
            f"{prefix}.{b}" if prefix else b
            for prefix, m in module.named_modules(remove_duplicate=False)
            for b in m._non_persistent_buffers_set
        ),
        tensor=tensor,
    )


def _tensor_plan(tp: TensorPlan | Mapping[str, str] | None, mesh: Any) -> TensorPlan | None:
    """``make_plan``'s ``tp`` as a ``TensorPlan`` at this rank's place on the mesh's tensor axis."""
    if tp is None or isinstance(tp, TensorPlan):
        return tp
    if not isinstance(tp, Mapping):
        raise TypeError(f"tp must be a {{pattern: style}} mapping or a TensorPlan, got {type(tp).__name__}")
    axes = [a for a in resolve_axes(mesh) if a.role is Role.TENSOR] if mesh is not None else []
    if len(axes) != 1:
        raise ValueError(
            "make_plan(tp=...) needs mesh=, a DeviceMesh with one tensor-parallel axis "
            '(init_device_mesh(..., mesh_dim_names=("dp", "tp"))): the axis\'s size and this rank\'s place on '
            "it decide each parameter's piece"
        )
    return TensorPlan.of(tp, axes[0].name, axes[0].size, axes[0].group.rank())


def _split(module: nn.Module, tensor: TensorPlan, spec: ParamSpec) -> ParamSpec:
    """``spec`` as this tensor-parallel rank holds it: its piece's shape and the dimension split."""
    dims = set()
    for name in (spec.name, *spec.aliases):
        path, _, attr = name.rpartition(".")
        dims.add(tensor.split_dim(path, attr, module.get_submodule(path)))
    if len(dims) > 1:
        raise ValueError(
            f"tied parameter {spec.name!r} (also {', '.join(map(repr, spec.aliases))}) is split on different "
            f"dimensions by its modules' tensor-parallel styles ({sorted(map(str, dims))}); give its users "
            "styles that split it alike (embedding_rowwise and colwise split the vocabulary both)"
        )
    dim = dims.pop()
    if dim is None:
        return spec
    return dataclasses.replace(spec, shape=tensor.local_shape(spec.shape, dim), split=(dim, spec.shape[dim]))


def _parameters(module: nn.Module) -> tuple[dict[int, nn.Parameter], dict[int, list[str]]]:
    """Every parameter by identity, and every name it is reachable by (a tied one has several)."""
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    for path, m in module.named_modules():
        if isinstance(m, nn.Embedding) and m.max_norm is not None:
            raise ValueError(
                f"nn.Embedding {path!r} has max_norm={m.max_norm}: its forward rescales the rows it reads in "
                "place, changing the parameter outside the optimizer; under sharding each rank reads other rows "
                "of a gathered copy that is freed after the call, so the change would be lost. Drop max_norm "
                "(or renormalise the rows after each step, on the full parameters)"
            )
    return tensors, names_of


def _chosen_units(module: nn.Module, policy: Policy, tensors: dict[int, nn.Parameter]) -> set[str]:
    """The module paths ``policy`` makes units, walking the tree as torch's auto-wrap does."""
    claimed: set[int] = set()
    chosen: set[str] = set()

    def unclaimed_numel(m: nn.Module) -> tuple[int, set[int]]:
        ids = {id(p) for p in m.parameters()} - claimed
        return sum(tensors[i].numel() for i in ids), ids

    def visit(m: nn.Module, path: str) -> None:
        total, _ = unclaimed_numel(m)
        if _ask(policy, m, path, True, total):
            for child_name, child in m.named_children():
                visit(child, f"{path}.{child_name}" if path else child_name)
        if m is module:
            return
        remaining, ids = unclaimed_numel(m)
        if remaining and _ask(policy, m, path, False, remaining):
            if not _has_forward(m):
                raise ValueError(
                    f"policy chose module {unit_label(path)} ({type(m).__name__}) as a unit, "
                    "but its forward never runs, so it could never be gathered; "
                    "choose the modules inside it instead"
                )
            claimed.update(ids)
            chosen.add(path)

    visit(module, ROOT)
    wanted = getattr(policy, "layer_classes", None)
    if wanted and not any(isinstance(m, wanted) for m in module.modules()):
        raise ValueError(
            f"{getattr(policy, '__qualname__', 'the policy')}: {type(module).__name__} has no module of these "
            "classes, so no unit would be made and the whole model would be gathered at once; "
            "pass the block class the model is built from (or policy=None for one unit on purpose)"
        )
    return chosen


def _homes(
    tensors: dict[int, nn.Parameter], names_of: dict[int, list[str]], chosen: set[str]
) -> tuple[dict[str, list[ParamSpec]], dict[str, tuple[str, ...]]]:
    """Each parameter's unit: the deepest chosen one whose path contains every name of it; a tied
    parameter used in several units, a unit of its own (the second mapping: its users' paths)."""

    def owner(param_name: str) -> str:
        parts = param_name.split(".")[:-1]
        for k in range(len(parts), 0, -1):
            path = ".".join(parts[:k])
            if path in chosen:
                return path
        return ROOT

    members: dict[str, list[ParamSpec]] = {}
    shared: dict[str, tuple[str, ...]] = {}  # a tied parameter's own unit -> the modules using it
    for pid, names in names_of.items():
        p = tensors[pid]
        if p.dtype.is_complex or (p.requires_grad and not p.dtype.is_floating_point):
            raise TypeError(
                f"parameter {names[0]!r} has dtype {p.dtype}"
                f"{' and requires grad' if p.requires_grad else ''}; only floating-point parameters, and integer "
                "or bool ones that do not require grad, can be sharded (view a complex one as real: "
                "torch.view_as_real)"
            )
        spec = ParamSpec(names[0], tuple(p.shape), p.dtype, p.requires_grad, tuple(names[1:]))
        owners = {owner(n) for n in names}
        holders = tuple(dict.fromkeys(n.rpartition(".")[0] for n in names))
        if len(owners) == 1:
            home = owners.pop()
        elif ROOT in owners or ROOT in holders:
            home = ROOT  # the root stays gathered for the whole forward: every use sees it
        else:
            # Used in several units: a unit of its own, gathered by each module that uses it
            # (one unit for every parameter of a module shared whole by several units).
            home = next((u for u, h in shared.items() if h == holders), spec.name)
            shared[home] = holders
        members.setdefault(home, []).append(spec)
    return members, shared


def _split_root(module: nn.Module, members: dict[str, list[ParamSpec]], shared: dict[str, tuple[str, ...]]) -> None:
    """Move what the root holds into units by owning module (in place), keeping at the root only
    what the root itself uses or a module whose forward never runs holds."""
    for spec in members.pop(ROOT, []):
        holders = tuple(dict.fromkeys(n.rpartition(".")[0] for n in (spec.name, *spec.aliases)))
        if ROOT in holders or not all(_has_forward(module.get_submodule(h)) for h in holders):
            members.setdefault(ROOT, []).append(spec)
        elif len(holders) == 1:
            members.setdefault(holders[0], []).append(spec)
        else:
            home = next((u for u, h in shared.items() if h == holders), spec.name)
            members.setdefault(home, []).append(spec)
            shared[home] = holders


def _units_in_order(
    module: nn.Module, members: dict[str, list[ParamSpec]], shared: dict[str, tuple[str, ...]]
) -> list[Unit]:
    """The units: the root first, then by the first module path that uses each; one dtype for the
    trainable part (the frozen parts are one per dtype)."""
    # Every path a module is reachable by (a module shared by two units appears under each).
    position = {n: i for i, (n, _) in enumerate(module.named_modules(remove_duplicate=False))}

    def first_use(name: str) -> int:
        return min(position[h] for h in shared[name]) if name in shared else position[name]

    order = sorted((n for n in members if n != ROOT), key=lambda n: (first_use(n), n in shared))
    units = []
    for name in ([ROOT] if ROOT in members else []) + order:
        specs = members[name]
        units.append(
            Unit(
                name,
                tuple(s for s in specs if s.requires_grad),
                tuple(s for s in specs if not s.requires_grad),
                shared.get(name, ()),
                lookup=name != ROOT and name not in shared and _is_lookup(module.get_submodule(name), name, specs),
            )
        )
    for u in units:
        if len({p.dtype for p in u.params}) > 1:
            detail = ", ".join(f"{p.name}: {_dtype_name(p.dtype)}" for p in u.params)
            raise TypeError(
                f"unit {unit_label(u.name)} mixes dtypes in its trainable parameters ({detail}); a unit is one "
                "flat buffer of one dtype: cast the module or choose a policy that separates them"
            )
    return units
