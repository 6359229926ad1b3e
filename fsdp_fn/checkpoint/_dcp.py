"""A rank's flat shard as torch.distributed.checkpoint (DCP) chunks of each parameter, keyed by FQN.

A rank holds a contiguous range of each parameter's flattened elements. DCP describes a
tensor's local data as rectangles (``ChunkStorageMetadata``: offsets and sizes in the
N-D parameter), so a range becomes a few rectangles (a partial row, whole rows, a
partial row; more for higher ranks). Each rectangle is itself a contiguous range, so it
is a plain view of the shard: saving writes from the shard, loading writes into it.
DCP then computes the overlap of saved and requested rectangles, which is what loads
a checkpoint at another world size, another plan, or from torch FSDP2's DTensors.

Under tensor parallelism a rank's flat range runs over its piece of a parameter (the plan's
``ParamSpec.shape``), which sits at an offset along the split dimension of the whole one
(``Placement``): the rectangles are the piece's, moved by that offset and sized against the
whole, so the checkpoint holds global names and shapes, as FSDP2 + TP's DTensors write them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fsdp_fn._plan import ParamSpec
from fsdp_fn._tp_plan import TensorPlan, chunk_bounds


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


@dataclass(frozen=True)
class Placement:
    """Where the tensor a rank's flat range runs over (``ParamSpec.shape``) sits in the whole one.

    Without tensor parallelism, or for a parameter the tensor-parallel axis does not split,
    it is the whole tensor (``origin`` all zeros); else this rank's piece along the split
    dimension, which starts at ``origin`` (``torch.chunk``'s pieces, as DTensor's ``Shard``).

    >>> p = Placement.of(ParamSpec("w", (3, 4), torch.float32, split=(1, 7)), TensorPlan((), size=2, rank=1))
    >>> p.whole, p.origin, p.moved((1, 2))
    ((3, 7), (0, 4), (1, 6))
    """

    whole: tuple[int, ...]
    origin: tuple[int, ...]

    @classmethod
    def of(cls, spec: ParamSpec, tensor: TensorPlan | None) -> Placement:
        """``spec``'s piece as this rank of ``tensor`` (the plan's ``Plan.tensor``) holds it."""
        if spec.split is None or tensor is None:
            return cls(spec.shape, (0,) * len(spec.shape))
        dim, length = spec.split
        lo, _ = chunk_bounds(length, tensor.size, tensor.rank)
        return cls(whole_shape(spec), tuple(lo if d == dim else 0 for d in range(len(spec.shape))))

    def moved(self, offsets: tuple[int, ...]) -> tuple[int, ...]:
        """Offsets in the piece as offsets in the whole tensor."""
        return tuple(o + a for o, a in zip(offsets, self.origin, strict=True))


def whole_shape(spec: ParamSpec) -> tuple[int, ...]:
    """The whole parameter's shape (``spec.shape`` is a tensor-parallel rank's piece when ``split`` is set)."""
    if spec.split is None:
        return spec.shape
    dim, length = spec.split
    return (*spec.shape[:dim], length, *spec.shape[dim + 1 :])


def runs(whole: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """The rectangle ``offsets``/``sizes`` of a row-major tensor of shape ``whole`` as contiguous runs:
    ``(start in the whole tensor's flat order, start in the rectangle's own flat order, length)``,
    in order, adjacent runs merged.

    >>> list(runs((3, 7), (1, 4), (2, 3)))
    [(11, 0, 3), (18, 3, 3)]
    >>> list(runs((3, 7), (1, 0), (2, 7)))
    [(7, 0, 14)]
    """
    if not whole:
        yield (0, 0, 1)
        return
    if math.prod(sizes) == 0:
        return
    k = len(whole) - 1  # the dimensions after ``k`` are whole in the rectangle: a run spans ``k`` and them
    while k > 0 and sizes[k] == whole[k]:
        k -= 1
    strides = [math.prod(whole[d + 1 :]) for d in range(len(whole))]
    length = math.prod(sizes[k:])
    base = sum(o * s for o, s in zip(offsets, strides, strict=True))
    pending: tuple[int, int, int] | None = None
    for n, index in enumerate(itertools.product(*(range(s) for s in sizes[:k]))):
        at = base + sum(i * s for i, s in zip(index, strides, strict=False))
        if pending is not None and pending[0] + pending[2] == at:
            pending = (pending[0], pending[1], pending[2] + length)
            continue
        if pending is not None:
            yield pending
        pending = (at, n * length, length)
    if pending is not None:
        yield pending


class Pieces:
    """This rank's part of one tensor, as DCP chunks that are views of a flat buffer.

    Implements DCP's checkpointable protocol (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``), as DTensor does; the planners
    below look chunks up here instead of treating the value as one whole tensor.
    """

    def __init__(
        self, shape: tuple[int, ...], flat: torch.Tensor, lo: int, hi: int, place: Placement | None = None
    ) -> None:
        """``flat[i]`` holds element ``lo + i`` of the flattened tensor of ``shape``, for ``i < hi - lo``;
        that tensor is the whole one, or a tensor-parallel piece of it placed by ``place``."""
        self.shape = torch.Size(shape if place is None else place.whole)
        self.dtype = flat.dtype
        self.chunks = {
            (b.offsets if place is None else place.moved(b.offsets)): flat[b.start - lo : b.start - lo + b.numel].view(
                b.sizes
            )
            for b in boxes(shape, lo, hi)
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
