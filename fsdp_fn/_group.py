"""Which ranks shard together: a torch ``ProcessGroup`` or a 1-D ``DeviceMesh``."""

from __future__ import annotations

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


def resolve_groups(group: Group) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group or None): a 2-D ``DeviceMesh`` (replicate, shard) means
    hybrid sharding; anything else is what ``resolve_group`` takes."""
    if isinstance(group, DeviceMesh) and group.ndim == 2:
        if not dist.is_initialized():
            resolve_group(None)  # raises the not-initialised error
        return group.get_group(1), group.get_group(0)
    if isinstance(group, DeviceMesh) and group.ndim > 2:
        raise ValueError(
            f"a {group.ndim}-D DeviceMesh was given; fsdp_fn takes a 1-D mesh (shard) or a 2-D one (replicate, shard)"
        )
    return resolve_group(group), None
