"""Sharded parameters: for each unit, this rank's slice of one flat, padded buffer."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree

from fsdp_fn._agree import agree
from fsdp_fn._collectives import _ReduceScatter, all_gather, all_reduce_sum
from fsdp_fn._group import Axis, Group, Role, resolve_axes
from fsdp_fn._guard import guarded
from fsdp_fn._plan import Plan, Unit, unit_label
from fsdp_fn._tp import gather_dim
from fsdp_fn._tree import NAMESPACE

__all__ = ["NAMESPACE", "Layout", "Sharded", "reduce_grads", "shard", "unshard"]


class Layout:
    """Static metadata of a ``Sharded`` tree: the plan, the mesh's named axes, and the frozen shards.

    ``axes`` (``_group.Axis``, in mesh order): exactly one shards the units (``group``:
    its process group); any others replicate them (hybrid sharding: their ranks average
    their gradients). ``frozen`` holds this rank's shards of the units' frozen parameters:
    constants that ride along, so gradients and optimizer state built by ``tree_map``
    never include them.

    Args:
        plan: the plan the shards follow.
        mesh: the axes (``resolve_axes``'s), or a ``ProcessGroup``: one shard axis.
        frozen: this rank's frozen shards by unit name: one per ``Unit.frozen_parts``
            (one per dtype), in that order.
    """

    __slots__ = (
        "axes",
        "frozen",
        "group",
        "guard_group",
        "plan",
        "replica_axes",
        "replica_groups",
        "replicas",
        "tensor_axis",
    )

    def __init__(
        self,
        plan: Plan,
        mesh: tuple[Axis, ...] | dist.ProcessGroup,
        frozen: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        axes = (Axis(Role.SHARD.value, Role.SHARD, mesh),) if isinstance(mesh, dist.ProcessGroup) else tuple(mesh)
        shards = [a for a in axes if a.role is Role.SHARD]
        if len(shards) != 1:
            raise ValueError(f"a layout shards over exactly one axis, got {axes}")
        self.plan, self.axes = plan, axes
        self.frozen: Mapping[str, tuple[torch.Tensor, ...]] = {} if frozen is None else frozen
        self.group: dist.ProcessGroup = shards[0].group
        # (a replicate axis of size 1 has nothing to average)
        self.replica_axes = tuple(a for a in axes if a.role is Role.REPLICATE and a.size > 1)
        self.replica_groups = tuple(a.group for a in self.replica_axes)
        self.replicas = math.prod(a.size for a in self.replica_axes)  # 1: no replicas
        # (an axis of size 1 splits nothing: the plan's pieces are whole)
        self.tensor_axis: Axis | None = next((a for a in axes if a.role is Role.TENSOR and a.size > 1), None)
        # A step's guard watches every rank its collectives reach: with replicas (or a tensor axis) a
        # rank waits on peers of other shard groups, and a failure must be seen (and named) by all of them.
        others = self.replicas * (self.tensor_axis.size if self.tensor_axis is not None else 1)
        spans_world = others > 1 and self.world * others == dist.get_world_size()
        self.guard_group: dist.ProcessGroup = dist.group.WORLD if spans_world else self.group  # type: ignore[assignment]

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, name):
            raise AttributeError(f"a Layout is immutable: {name!r} cannot change (make another one)")
        object.__setattr__(self, name, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> Layout:
        # The plan and the axes' process groups are shared (a group is a live connection, not
        # data); the frozen shards are copied, as every other tensor of the copied tree.
        return Layout(self.plan, self.axes, copy.deepcopy(dict(self.frozen), memo))

    def __reduce__(self) -> Any:
        raise TypeError(
            "sharded parameters and optimizer states cannot be pickled: their layout holds process groups "
            "(live connections to the other ranks); copy.deepcopy them in the same job, save them with "
            "fsdp_fn.checkpoint.save(dir, state) (loadable at another world size), or pickle plain tensors "
            "(dict(params): this rank's shards; ff.unshard(params): the whole parameters)"
        )

    @property
    def world(self) -> int:
        """Ranks of the shard axis: each unit is split in this many shards."""
        return self.group.size()

    @property
    def rank(self) -> int:
        """This rank's place on the shard axis: which shard it holds."""
        return self.group.rank()

    @property
    def groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Every axis's group, in mesh order."""
        return tuple(a.group for a in self.axes)

    @property
    def first_replica(self) -> bool:
        """Whether this rank is the first along every replicate axis (the one that writes what replicas share)."""
        return all(g.rank() == 0 for g in self.replica_groups)

    def counted(self, unit: Unit) -> tuple[bool, ...] | None:
        """Which of ``unit``'s trainable parameters this rank counts in a norm over the whole model:
        under tensor parallelism a parameter the axis does not split (a norm's weight, a row-split
        bias) is the same on every rank of it, so only its first rank counts it. ``None``: all."""
        axis = self.tensor_axis
        if axis is None or axis.group.rank() == 0:
            return None
        return tuple(p.split is not None for p in unit.params)

    def counted_parts(
        self, unit: Unit, shard: torch.Tensor, mask: tuple[bool, ...] | None = None
    ) -> list[torch.Tensor]:
        """This rank's elements of ``unit``'s ``shard`` that a norm over the whole model counts: the
        parameters ``mask`` marks (``None``: all) that ``counted`` keeps; the whole shard (its
        padding is zero) when that is all of them, else one view per parameter."""
        counted = self.counted(unit)
        if counted is not None:
            mask = counted if mask is None else tuple(a and b for a, b in zip(mask, counted, strict=True))
        if mask is None or all(mask):
            return [shard]
        return [shard[lo:hi] for i, lo, hi in unit.local_ranges(self.world, self.rank) if mask[i] and lo < hi]

    def with_frozen(self, frozen: Mapping[str, tuple[torch.Tensor, ...]]) -> Layout:
        """The same plan and axes with other frozen shards (moved, loaded)."""
        return Layout(self.plan, self.axes, frozen)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Layout)
            and len(other.axes) == len(self.axes)
            and all(a.group is b.group and a.role is b.role for a, b in zip(other.axes, self.axes, strict=True))
            and other.frozen is self.frozen
            and other.plan == self.plan
        )

    def __hash__(self) -> int:
        return hash((self.plan, tuple(id(a.group) for a in self.axes), id(self.frozen)))

    def __repr__(self) -> str:
        return f"Layout({len(self.plan.units)} units, axes {self.axes})"


class Sharded:
    """One tensor per unit (this rank's 1-D shard, ``ceil(numel / W)`` elements) and the layout.

    A pytree node for optree (namespace ``"fsdp_fn"``) and for ``torch.utils._pytree``
    (so ``torch.func`` transforms see the shard tensors as leaves). Gradients, updates and
    optimizer moments share this type, so they are sharded by construction.

    ``received`` (gradients and updates): for each unit, which of its trainable parameters
    got a gradient (``value_and_grad`` sets it; ``None`` means all of them). Optimizers
    skip the others, as torch.optim skips a parameter whose ``.grad`` is ``None``. It is
    part of the tree's structure, like the layout: ``tree_map(f, grads)`` keeps it, and two
    trees that differ only there still map together (the result has the first tree's
    structure, as optree's does). ``consumed`` says why the shards may no longer be used
    (donated to a step, left half-updated by a failed one). Making one copies no tensor
    and communicates nothing.

    Args:
        shards: one tensor per unit, keyed by unit name in plan order (usually this rank's
            1-D shard; a transform may put any leaf there).
        layout: the plan, the groups and the frozen shards (shared by every tree of one
            model: parameters, gradients, moments).
        received: for each unit, which of its trainable parameters got a gradient;
            ``None``: all of them.

    Raises:
        ValueError: if ``shards`` is not keyed by the plan's units, in plan order.
    """

    __slots__ = ("consumed", "layout", "received", "shards")

    def __init__(
        self, shards: Mapping[str, Any], layout: Layout, received: Mapping[str, tuple[bool, ...]] | None = None
    ) -> None:
        names = layout.plan.unit_names
        if tuple(shards) != names:
            raise ValueError(f"shards are keyed {tuple(shards)}, the plan's units are {names}")
        self.shards = dict(shards)
        self.layout = layout
        self.received = dict(received) if received is not None else None
        self.consumed: str | None = None

    @property
    def plan(self) -> Plan:
        """The plan the shards were made for."""
        return self.layout.plan

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the units are sharded over."""
        return self.layout.group

    def __getitem__(self, unit: str) -> Any:
        return self.shards[unit]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)

    def values(self) -> list[Any]:
        """The shards, in plan order (what a ``torch.optim`` optimizer is built on for ``from_torch``).

        Returns:
            A new list of the shard tensors; the tensors themselves are not copied.
        """
        return list(self.shards.values())

    def replace(self, shards: Mapping[str, Any]) -> Sharded:
        """New shards in this tree's structure (its layout and ``received``).

        Args:
            shards: one tensor per unit, keyed by unit name in plan order.

        Returns:
            A new ``Sharded``; no tensor is copied.

        Raises:
            ValueError: if ``shards`` is not keyed by the plan's units, in plan order.
        """
        return Sharded(shards, self.layout, self.received)

    def with_received(self, received: Mapping[str, tuple[bool, ...]] | None) -> Sharded:
        """The same shards, marking which parameters of each unit got a gradient.

        Args:
            received: for each unit, one bool per trainable parameter; a unit left out got
                none; ``None``: every parameter got one.

        Returns:
            A new ``Sharded`` over the same tensors (no copy).
        """
        return Sharded(self.shards, self.layout, received)

    def mask(self, unit: Unit) -> tuple[bool, ...]:
        """Which of ``unit``'s trainable parameters got a gradient (all, without ``received``).

        Args:
            unit: a unit of the plan.

        Returns:
            One bool per parameter of ``unit.params``, in order.
        """
        if self.received is None:
            return (True,) * len(unit.params)
        return tuple(self.received.get(unit.name, (False,) * len(unit.params)))

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{unit_label(k)}: {tuple(v.shape) if isinstance(v, torch.Tensor) else v!r}" for k, v in self.shards.items()
        )
        return f"Sharded(world={self.layout.world}, rank={self.layout.rank}, {{{inner}}})"


class _Structure:
    """A ``Sharded`` node's static part: its layout, and which parameters got a gradient.

    Equal when the layouts are: ``received`` rides along (``tree_map`` keeps it) but does
    not stop a gradient and the parameters from mapping together."""

    __slots__ = ("layout", "received")

    def __init__(self, layout: Layout, received: dict[str, tuple[bool, ...]] | None) -> None:
        self.layout, self.received = layout, received

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Structure) and other.layout == self.layout

    def __hash__(self) -> int:
        return hash(self.layout)


def _flatten(s: Sharded) -> tuple[list[Any], _Structure, tuple[str, ...]]:
    return list(s.shards.values()), _Structure(s.layout, s.received), tuple(s.shards)


def _unflatten(structure: _Structure, children: Any) -> Sharded:
    layout = structure.layout
    return Sharded(dict(zip(layout.plan.unit_names, children, strict=True)), layout, structure.received)


optree.register_pytree_node(Sharded, _flatten, _unflatten, namespace=NAMESPACE)  # type: ignore[arg-type]
torch_pytree.register_pytree_node(
    Sharded,
    lambda s: (list(s.shards.values()), _Structure(s.layout, s.received)),
    lambda children, structure: _unflatten(structure, children),
)


def sharded_in(tree: Any) -> list[Sharded]:
    """The ``Sharded`` nodes of ``tree`` (a train state, an optimizer state, ...)."""
    nodes = optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Sharded), namespace=NAMESPACE)
    return [node for node in nodes if isinstance(node, Sharded)]


def ensure_live(tree: Any, what: str) -> None:
    """Raise if a ``Sharded`` in ``tree`` was donated to a step (its tensors now hold the
    step's result) or left half-updated by a failed step."""
    for node in sharded_in(tree):
        if node.consumed is not None:
            raise RuntimeError(f"{what}: {node.consumed}")


# --- shard / unshard / reduce_grads -----------------------------------------------------


def check_params(params: Mapping[str, torch.Tensor], plan: Plan) -> None:
    """Raise unless ``params`` has exactly the plan's parameters, shapes and dtypes."""
    expected = {p.name: p for p in plan.params}
    missing = [n for n in expected if n not in params]
    extra = [n for n in params if n not in expected]
    if missing or extra:
        raise KeyError(
            f"params do not match the plan: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    for unit in plan.units:
        _device_of(unit, params)
    for name, spec in expected.items():
        t = params[name]
        if isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device and holds no values: "
                "init_shards(module, plan, group) materialises a meta model unit by unit"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ValueError(
                f"parameter {name!r} is {tuple(t.shape)} {t.dtype}; the plan has "
                f"{spec.shape} {spec.dtype} (unit {unit_label(plan.unit_of(name).name)})"
            )


def local_slice(unit: Unit, params: Mapping[str, torch.Tensor], world: int, rank: int) -> torch.Tensor:
    """This rank's shard of ``unit``'s (trainable) flat buffer, copied from full ``params``
    without building the flat buffer. A part of ``unit.frozen_parts`` gives a frozen one."""
    n = unit.shard_numel(world)
    lo, hi = rank * n, (rank + 1) * n
    out = torch.zeros(n, dtype=unit.dtype, device=_device_of(unit, params))
    for spec, at in zip(unit.params, unit.offsets, strict=True):
        a, b = max(lo, at), min(hi, at + spec.numel)
        if a < b:
            out[a - lo : b - lo] = params[spec.name].detach().reshape(-1)[a - at : b - at]
    return out


def frozen_slices(unit: Unit, params: Mapping[str, torch.Tensor], world: int, rank: int) -> tuple[torch.Tensor, ...]:
    """This rank's shard of each of ``unit``'s frozen parts (``local_slice`` of each), each in its own dtype."""
    return tuple(local_slice(part, params, world, rank) for part in unit.frozen_parts)


def _device_of(unit: Unit, params: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {params[p.name].device for p in unit.all_params}
    if len(devices) > 1:
        raise ValueError(f"unit {unit_label(unit.name)} has parameters on several devices: {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


def unit_views(unit: Unit, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The unit's parameters as views into its flat (gathered) buffer; no copy.

    One ``split`` (not a slice per parameter), so backward assembles the flat gradient
    with one concatenation instead of a zero-filled full-size buffer per parameter.
    """
    sizes = [spec.numel for spec in unit.params]
    pieces = flat.split_with_sizes([*sizes, flat.numel() - sum(sizes)])
    return {spec.name: piece.view(spec.shape) for spec, piece in zip(unit.params, pieces, strict=False)}


def check_shard(sharded: Sharded, unit: Unit) -> torch.Tensor:
    t = sharded[unit.name]
    want = unit.shard_numel(sharded.layout.world)
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != want:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"shard of unit {unit_label(unit.name)} is {got}; world size {sharded.layout.world} "
            f"needs ({want},): were these shards made for another plan or world size?"
        )
    return t


def shards_of(sharded: Sharded, unit: Unit) -> list[tuple[Unit, torch.Tensor]]:
    """The unit's flat parts with this rank's shard of each: trainable, then the frozen ones (one per dtype)."""
    parts = [(unit, check_shard(sharded, unit))]
    if unit.frozen:
        parts.extend(zip(unit.frozen_parts, sharded.layout.frozen[unit.name], strict=True))
    return parts


def shard(params: Mapping[str, torch.Tensor], plan: Plan, group: Group = None, *, timeout: float = 300.0) -> Sharded:
    """Keep this rank's 1/W of every unit: one flat, padded 1-D shard per unit.

    Memory: allocates only this rank's shards (``ceil(numel/W)`` per unit); the full
    parameters are read, never concatenated. Communication: one small all-gather of the
    plan's fingerprint and per-unit checksums, so a plan or an initialisation that differs
    between ranks fails here, naming the unit and the ranks.

    Args:
        params: the full parameters by canonical name (``fn.params``, or
            ``dict(module.named_parameters())``), the same values on every rank.
        plan: the plan to shard by, the same on every rank.
        group: the ranks that shard together: a ``ProcessGroup``, a 1-D ``DeviceMesh``, a
            mesh of named axes for hybrid sharding (one shard axis, replicate axes: see
            ``resolve_axes``; a 2-D mesh without such names is (replicate, shard)), or
            ``None`` (the default group).
        timeout: seconds to wait on the other ranks while they agree on the plan and the
            values.

    Returns:
        This rank's ``Sharded`` parameters (frozen parameters' shards in its layout).

    Raises:
        TypeError: if ``plan`` is not a ``Plan``, a parameter is not a tensor, or ``group``
            is not a group, mesh or ``None``.
        KeyError: if ``params`` misses a parameter of the plan or has one it does not.
        ValueError: if a parameter's shape or dtype differs from the plan's, it is on the
            meta device, a unit's parameters are on several devices, or ``group`` is a
            mesh without exactly one shard axis (or with an axis of a parallelism not run
            yet, such as ``"tp"``) or a group this rank is not a member of.
        RuntimeError: if ``torch.distributed`` is not initialised.
        DivergenceError: if the ranks' plans or initial values differ (naming the unit).
        RankFailure: if another rank failed or went silent for ``timeout``.

    >>> import torch, torch.distributed as dist
    >>> from torch import nn
    >>> if not dist.is_initialized():
    ...     dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
    >>> from fsdp_fn import make_plan
    >>> m = nn.Linear(3, 2)
    >>> p = shard(dict(m.named_parameters()), make_plan(m))
    >>> p[""].shape  # 8 elements on one rank
    torch.Size([8])
    """
    axes = resolve_axes(group)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan (from make_plan), got {type(plan).__name__}")
    tensor_axis = _tensor_axis(plan, axes)
    if tensor_axis is not None:
        with guarded(tensor_axis.group, "shard", timeout):
            _agree_on_tensor_plan(plan, params, tensor_axis.group)
        assert plan.tensor is not None
        params = {
            n: plan.tensor.local(params[n], spec.split) if (spec := plan._planned.get(n)) else t
            for n, t in params.items()
        }
    check_params(params, plan)
    shard_axis = next(a for a in axes if a.role is Role.SHARD)
    world, rank = shard_axis.size, shard_axis.group.rank()
    for g in (a.group for a in axes if a is not tensor_axis):
        with guarded(g, "shard", timeout):
            agree(
                g,
                "plans",
                {
                    "plan": plan.fingerprint(),
                    **{f"unit {unit_label(k)}": v for k, v in plan.unit_fingerprints().items()},
                },
                hint="build the plan from the same model and policy on every rank",
            )
            agree(
                g,
                "initial parameters",
                {f"unit {unit_label(u.name)}": _checksum(u, params) for u in plan.units},
                hint="initialise the model with the same seed on every rank",
            )
    frozen = {u.name: frozen_slices(u, params, world, rank) for u in plan.units if u.frozen}
    layout = Layout(plan, axes, frozen)
    return Sharded({u.name: local_slice(u, params, world, rank) for u in plan.units}, layout)


def _tensor_axis(plan: Plan, axes: tuple[Axis, ...]) -> Axis | None:
    """The mesh's tensor-parallel axis, checked against the plan's (``None``: no tensor parallelism)."""
    axis = next((a for a in axes if a.role is Role.TENSOR), None)
    tensor = plan.tensor
    if tensor is None:
        if axis is not None and axis.size > 1:
            raise ValueError(
                f"the mesh's axis {axis.name!r} is tensor-parallel ({axis.size} ranks) but the plan splits no module "
                "over it: make the plan with make_plan(model, policy, tp=model._tp_plan (or styles of your own), "
                "mesh=mesh)"
            )
        return None
    if axis is None or axis.size != tensor.size or axis.group.rank() != tensor.rank:
        where = (
            "no tensor-parallel axis"
            if axis is None
            else f"axis {axis.name!r}: {axis.size} ranks, this rank at {axis.group.rank()}"
        )
        raise ValueError(
            f"the plan splits its modules over a tensor-parallel axis of {tensor.size} ranks, this rank at "
            f"{tensor.rank}; the mesh has {where}: make the plan with the mesh it is sharded over "
            "(make_plan(..., tp=..., mesh=mesh))"
        )
    return axis


def _agree_on_tensor_plan(plan: Plan, params: Mapping[str, torch.Tensor], group: dist.ProcessGroup) -> None:
    """The ranks of a tensor-parallel axis hold the same styles and the same whole parameters (each
    then keeps its piece): one small all-gather of hashes and checksums."""
    assert plan.tensor is not None
    agree(
        group, "tensor-parallel plans", {"styles": plan.tensor.fingerprint()}, hint="pass every rank the same tp styles"
    )
    missing = [spec.name for spec in plan.params if spec.name not in params]
    if missing:
        raise KeyError(f"params do not match the plan: missing {missing[:5]}")
    sums = {f"unit {unit_label(u.name)}": _checksum(u, params) for u in plan.units}  # of the whole parameters
    agree(group, "initial parameters", sums, hint="initialise the model with the same seed on every rank")


def _checksum(unit: Unit, params: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    s = sq = 0.0
    with torch.no_grad():
        for spec in unit.all_params:
            t = params[spec.name].detach().double()
            s += float(t.sum())
            sq += float((t * t).sum())
    return s, sq


def unshard(sharded: Sharded, *, frozen: bool = True, timeout: float = 300.0) -> dict[str, torch.Tensor]:
    """Gather all parameters at full size, keyed by name: one all-gather per unit part.

    Memory: the whole model on every rank. For checkpoints, evaluation and tests. Under tensor
    parallelism each split parameter is gathered over that axis too (one all-gather more per
    split parameter), so every rank gets the whole model. Every rank of the group must call
    it (guarded: a rank that calls alone gets an error naming the ranks that did not join,
    within ``timeout`` seconds). Differentiable: its backward is the reduce-scatter, averaged
    over ranks.

    Args:
        sharded: sharded parameters (or a gradient, an optimizer moment: any ``Sharded``).
        frozen: also the frozen parameters' values, which the tree's layout holds, not its
            leaves; pass ``False`` for a gradient or an optimizer moment (its frozen
            entries would be the parameters' values, not gradients).
        timeout: seconds to wait on the other ranks.

    Returns:
        ``{canonical name: full tensor}``, views into one gathered buffer per unit part.

    Raises:
        RuntimeError: if ``sharded`` was donated to a train step or left half-updated by
            a failed one.
        ValueError: if a shard has the wrong length for the world size.
        RankFailure: if another rank failed, or did not join within ``timeout``.
    """
    ensure_live(sharded, "unshard")
    out: dict[str, torch.Tensor] = {}
    world = sharded.layout.world
    with guarded(sharded.group, "unshard", timeout):
        for unit in sharded.plan.units:
            parts = shards_of(sharded, unit)  # the trainable part first
            for part, shard in parts if frozen else parts[:1]:
                flat = all_gather(shard, sharded.group, unit=unit.name, grad_scale=1.0 / world)
                out.update(unit_views(part, flat))
        axis = sharded.layout.tensor_axis
        if axis is not None:
            with guarded(axis.group, "unshard", timeout):
                for spec in sharded.plan.params:
                    if spec.split is not None and spec.name in out:
                        out[spec.name] = gather_dim(out[spec.name], axis.group, spec.split)
    return out


def reduce_grads(grads: Mapping[str, torch.Tensor | None], like: Sharded, *, mean: bool = True) -> Sharded:
    """Reduce-scatter full gradients (keyed by parameter name) into ``like``'s sharded layout.

    For users who compute full gradients themselves. Differentiable (its backward is an
    all-gather; not across replicas). Memory: one unit's flat gradient at a time plus the
    result shards; communication: one reduce-scatter per unit (and, with a 2-D mesh, one
    all-reduce of its shard across the replicas).

    A unit whose parameters are all frozen gets an empty shard and no collective.

    Args:
        grads: full gradients by canonical parameter name; missing or ``None`` gradients
            count as zero. Each is cast to its unit's dtype.
        like: the sharded parameters whose layout the result takes.
        mean: ``True`` averages over ranks (like DDP), ``False`` sums; with a 2-D mesh,
            over the replicas too.

    Returns:
        The gradient as a ``Sharded`` in ``like``'s structure.

    Raises:
        KeyError: if ``grads`` names a parameter that is not in the plan.
        ValueError: if a gradient's shape differs from its parameter's, or a tied parameter's
            gradients under two of its names differ.
    """
    plan, world = like.plan, like.layout.world
    unknown = [n for n in grads if not any(n == p.name or n in p.aliases for p in plan.params)]
    if unknown:
        raise KeyError(f"gradients for parameters not in the plan: {unknown[:5]}")
    out: dict[str, torch.Tensor] = {}
    for unit in plan.units:
        if not unit.params:  # frozen parameters alone: an empty gradient shard, as value_and_grad's; no collective
            out[unit.name] = torch.zeros(0, dtype=unit.dtype, device=like[unit.name].device)
            continue
        pieces = []
        for spec in unit.params:
            # A tied parameter's gradient may come under any of its names (once: a module's
            # named gradients list the same tensor under each; different values are ambiguous).
            named = [(n, t) for n in (spec.name, *spec.aliases) if (t := grads.get(n)) is not None]
            if any(t is not named[0][1] and not torch.equal(t, named[0][1]) for _, t in named[1:]):
                raise ValueError(
                    f"gradients of tied parameter {spec.name!r} differ under its names {[n for n, _ in named]}: "
                    "give it once, under any one of them (autograd's gradient of a tied weight is one tensor)"
                )
            g = named[0][1] if named else None
            if g is None:
                pieces.append(torch.zeros(spec.numel, dtype=unit.dtype, device=like[unit.name].device))
            else:
                if tuple(g.shape) != spec.shape:
                    raise ValueError(f"gradient of {spec.name!r} is {tuple(g.shape)}, the parameter is {spec.shape}")
                pieces.append(g.reshape(-1).to(unit.dtype))
        pad = unit.padded_numel(world) - unit.numel
        if pad:
            pieces.append(torch.zeros(pad, dtype=unit.dtype, device=like[unit.name].device))
        flat = torch.cat(pieces)
        scale = 1.0 / world if mean else 1.0
        shard = _ReduceScatter.apply(flat, like.group, unit.name, scale)
        for axis in like.layout.replica_axes:  # hybrid sharding: then across the replicas (differentiably)
            shard = all_reduce_sum(shard, axis.group, unit=unit.name, scale=1.0 / axis.size if mean else 1.0)
        out[unit.name] = shard
    return like.replace(out)
