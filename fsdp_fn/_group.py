"""Which ranks shard together: a torch ``ProcessGroup``, or a ``DeviceMesh`` of named axes.

A mesh is read as a tuple of ``Axis`` values, each a name, its ranks' group and its role:
``SHARD`` (the units are split over it) or ``REPLICATE`` (its ranks hold the same shards and
average their gradients, as DDP's replicas). A new kind of parallelism is a new role, not a
new branch in every reduction: code that reduces over the replicas loops over
``replica_axes``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Group = dist.ProcessGroup | DeviceMesh | None


def resolve_group(group: Group) -> dist.ProcessGroup:
    """The process group to shard over; ``None`` means the default (world) group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first "
            "(torchrun sets the environment it needs); for one process use world_size=1"
        )
    if group is None:
        world = dist.group.WORLD
        assert world is not None
        return world
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a {group.ndim}-D DeviceMesh {group.mesh_dim_names or ''} was given; "
                "sharding takes a 1-D mesh (or a ProcessGroup)"
            )
        return group.get_group()
    # torch's new_group hands the ranks it leaves out NON_GROUP_MEMBER (an int), not a group
    if (isinstance(group, dist.ProcessGroup) and group.rank() < 0) or _not_a_member(group):
        raise ValueError(
            f"this rank ({dist.get_rank()}) is not a member of the process group given: torch.distributed.new_group "
            "returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out; call fsdp_fn only on the ranks of "
            "the group (every rank of it, the same calls), and on the others with a group of their own"
        )
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {_kind(group)}")


def _not_a_member(group: Any) -> bool:
    return isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER


def _kind(x: Any) -> str:
    return type(x).__name__


class Role(enum.Enum):
    """What an axis of the mesh does."""

    SHARD = "shard"  # every unit is split over the axis's ranks
    REPLICATE = "replicate"  # the axis's ranks hold the same shards; their gradients are averaged
    TENSOR = "tensor"  # the plan's split modules are split over the axis's ranks; they see the same batch


@dataclass(frozen=True, eq=False)
class Axis:
    """One named axis of the mesh: its name, what it does, and the group of this rank's peers along it.

    Attributes:
        name: the mesh's name for the axis (``mesh_dim_names``), or its role's.
        role: ``Role.SHARD``, ``Role.REPLICATE`` or ``Role.TENSOR``.
        group: the process group of the ranks along the axis that this rank belongs to.
    """

    name: str
    role: Role
    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        """Ranks along the axis."""
        return self.group.size()

    def __repr__(self) -> str:
        return f"Axis({self.name!r}, {self.role.value}, {self.size} ranks)"


# Mesh dimension names (torchtitan's, FSDP2's, the conventional ones) and the role they mean.
ROLE_OF_NAME = {
    "shard": Role.SHARD,
    "fsdp": Role.SHARD,
    "dp_shard": Role.SHARD,
    "dp": Role.SHARD,  # beside "tp": the data-parallel axis FSDP shards over (torchtitan's, FSDP2 + TP's)
    "replicate": Role.REPLICATE,
    "dp_replicate": Role.REPLICATE,
    "ddp": Role.REPLICATE,
    "tp": Role.TENSOR,
    "tensor": Role.TENSOR,
}
NOT_YET = {"cp": "context", "pp": "pipeline", "ep": "expert"}


def resolve_axes(group: Group) -> tuple[Axis, ...]:
    """The mesh ``group`` names, as axes in mesh order: exactly one of them shards.

    A ``ProcessGroup`` (or ``None``: the default group) or a 1-D mesh is one shard axis. A
    mesh of more dimensions takes each axis's role from its name (``ROLE_OF_NAME``:
    ``"shard"``/``"fsdp"``/``"dp_shard"``/``"dp"`` shard, ``"replicate"``/``"dp_replicate"``/``"ddp"``
    replicate, ``"tp"``/``"tensor"`` split the plan's tensor-parallel modules); without such
    names its last axis shards and the ones before it replicate
    (a 2-D mesh is (replicate, shard), as FSDP2's HSDP reads it). Communication: none (the
    mesh's groups exist already).

    Raises:
        ValueError: if the mesh has no shard axis or several, several tensor-parallel axes,
            or an axis is named for a kind of parallelism fsdp_fn does not run yet (``"pp"``, ...).
    """
    if not isinstance(group, DeviceMesh) or group.ndim == 1:
        pg = resolve_group(group)
        names = group.mesh_dim_names if isinstance(group, DeviceMesh) else None
        return (Axis(names[0] if names else Role.SHARD.value, Role.SHARD, pg),)
    if not dist.is_initialized():
        resolve_group(None)  # raises the not-initialised error
    names = tuple(group.mesh_dim_names or ())
    for name in names:
        if name.lower() in NOT_YET:
            raise ValueError(
                f"the mesh's axis {name!r} names {NOT_YET[name.lower()]} parallelism, which fsdp_fn does not run "
                f"yet; pass the mesh of its data axes (mesh[{tuple(n for n in names if n != name)!r}]), with one "
                "shard axis and any replicate axes"
            )
    known = [ROLE_OF_NAME.get(n.lower()) for n in names]
    if names and all(r is not None for r in known):
        roles = [r for r in known if r is not None]
    else:  # positional: the last axis shards, the others replicate
        roles = [Role.REPLICATE] * (group.ndim - 1) + [Role.SHARD]
        names = names or tuple(
            Role.SHARD.value if i == group.ndim - 1 else (f"replicate{i}" if group.ndim > 2 else "replicate")
            for i in range(group.ndim)
        )
    shards = [n for n, r in zip(names, roles, strict=True) if r is Role.SHARD]
    if len(shards) != 1:
        raise ValueError(
            f"the mesh {names} has {len(shards)} shard axes ({', '.join(map(repr, shards)) or 'none'}); fsdp_fn "
            "shards over exactly one axis (flatten several into one: mesh[(a, b)]._flatten()) and replicates over "
            "the others"
        )
    if roles.count(Role.TENSOR) > 1:
        raise ValueError(f"the mesh {names} has several tensor-parallel axes; fsdp_fn splits over one")
    return tuple(Axis(n, r, group.get_group(i)) for i, (n, r) in enumerate(zip(names, roles, strict=True)))
