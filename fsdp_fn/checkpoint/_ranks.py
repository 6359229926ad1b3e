"""The ranks a checkpoint call runs over, and how a failure on some of them becomes one ``CheckpointError`` on all.

>>> _converted(OSError("No space left on device"), "cannot write run/step_1")
CheckpointError('cannot write run/step_1: OSError: No space left on device')
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_fn._agree import failures
from fsdp_fn._shard import Layout
from fsdp_fn.checkpoint._integrity import CheckpointError


def _group(layout: Layout) -> dist.ProcessGroup:
    """Every rank that holds the state: the shard group; the one axis of more than one rank (a
    ``(1, tp)`` mesh: its tensor-parallel axis); else, with replicas or a tensor-parallel axis
    beside the shard axis, the whole world."""
    spread = [a for a in layout.axes if a.size > 1]
    if len(spread) <= 1:
        return spread[0].group if spread else layout.group
    world = dist.group.WORLD
    assert world is not None
    tensor = layout.tensor_axis.size if layout.tensor_axis is not None else 1
    if world.size() != layout.world * layout.replicas * tensor:
        what = ", ".join(f"{a.size} along {a.name!r} ({a.role.value})" for a in spread)
        raise ValueError(
            f"a state sharded over a mesh of several axes ({what}) checkpoints over the default group, "
            f"which has {world.size()} ranks, not {layout.world * layout.replicas * tensor}"
        )
    return world


def _mesh(layout: Layout) -> list[list[object]]:
    """The state's mesh as a checkpoint records it: each axis of more than one rank, its role and size,
    in mesh order (JSON). A load restores each rank's RNG state only onto the same mesh: a
    tensor-parallel axis's ranks draw alike, which another mesh's ranks at the same places need not."""
    return [[a.role.value, a.size] for a in layout.axes if a.size > 1]


def _agree_on_error(group: dist.ProcessGroup, error: str | None) -> None:
    """Raise the same ``CheckpointError`` on every rank if any rank has an error (``failures``)."""
    found = failures(error, [group], "checkpoint.save")
    if found:
        raise CheckpointError("; ".join(found))


def _converted(e: BaseException, what: str) -> CheckpointError:
    """One ``CheckpointError`` for a failure inside DCP (its ``CheckpointException`` is a
    ``BaseException`` carrying each rank's exception): the first line names the first rank's cause."""
    if isinstance(e, CheckpointException) and e.failures:
        rank = min(e.failures)
        cause = e.failures[rank][0]
        more = f" (and {len(e.failures) - 1} more ranks)" if len(e.failures) > 1 else ""
        if isinstance(cause, CheckpointError):  # it names the checkpoint already
            return CheckpointError(f"rank {rank}{more}: {cause}")
        return CheckpointError(f"{what}: rank {rank}{more}: {type(cause).__name__}: {cause}")
    return CheckpointError(f"{what}: {type(e).__name__}: {e}")
