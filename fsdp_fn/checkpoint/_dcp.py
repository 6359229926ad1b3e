"""A rank's flat shard as torch.distributed.checkpoint (DCP) chunks of each parameter, keyed by FQN.

A rank holds a contiguous range of each parameter's flattened elements. DCP describes a
tensor's local data as rectangles (``ChunkStorageMetadata``: offsets and sizes in the
N-D parameter), so a range becomes a few rectangles (a partial row, whole rows, a
partial row; more for higher ranks). Each rectangle is itself a contiguous range, so it
is a plain view of the shard: saving writes from the shard, loading writes into it.
DCP then computes the overlap of saved and requested rectangles, which is what loads
a checkpoint at another world size, another plan, or from torch FSDP2's DTensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class Box:
    """A rectangle of an N-D tensor that is also a contiguous flat range starting at ``start``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangles, in order.

    At most ``2 * ndim - 1`` of them: a partial sub-tensor, whole ones along the first
    dimension, a partial one, recursively.

    >>> [(b.offsets, b.sizes) for b in boxes((3, 4), 2, 11)]
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if lo >= hi:
        return []
    if not shape:
        return [Box((), (), 0)]
    inner = math.prod(shape[1:])
    first, lo_rem = divmod(lo, inner)
    last, hi_rem = divmod(hi, inner)

    def within(i: int, a: int, b: int) -> list[Box]:
        return [Box((i, *x.offsets), (1, *x.sizes), i * inner + x.start) for x in boxes(shape[1:], a, b)]

    if first == last:
        return within(first, lo_rem, hi_rem)
    out = []
    if lo_rem:
        out += within(first, lo_rem, inner)
        first += 1
    if last > first:
        out.append(Box((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:]), first * inner))
    if hi_rem:
        out += within(last, 0, hi_rem)
    return out


class Pieces:
    """This rank's part of one tensor, as DCP chunks that are views of a flat buffer.

    Implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``), as DTensor does; the planners
    below look chunks up here instead of treating the value as one whole tensor.
    """

    def __init__(self, shape: tuple[int, ...], flat: torch.Tensor, lo: int, hi: int) -> None:
        """``flat[i]`` holds element ``lo + i`` of the flattened tensor, for ``i < hi - lo``."""
        self.shape = torch.Size(shape)
        self.dtype = flat.dtype
        self.chunks = {
            b.offsets: flat[b.start - lo : b.start - lo + b.numel].view(b.sizes) for b in boxes(shape, lo, hi)
        }

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.shape,
                ),
            )
            for offsets, t in self.chunks.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), t.shape) for offsets, t in self.chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None
        return self.chunks[tuple(index.offset)]


def _lookup(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    value = state_dict[index.fqn]
    return value.__get_tensor_shard__(index) if isinstance(value, Pieces) else None


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner for a flat state dict, also finding chunks of ``Pieces`` values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for a flat state dict, also finding chunks of ``Pieces`` values.

    Its set-up keeps the values as they are (the default one replaces values it does not
    know, such as ``Pieces``, with ``None`` while it looks for meta tensors to allocate).
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found
