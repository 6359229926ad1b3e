"""Runtime policies, as values: when units are gathered, in which dtype, on which device."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as torch_pytree


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued in backward (the seed's ``backward_prefetch``).

    ``None`` in its place (``Schedule(backward_prefetch=None)``): when the unit's backward
    needs it, with no overlap and one unit gathered at a time.
    """

    BACKWARD_PRE = "pre"
    """While this unit's gradients are computed: most overlap, two units gathered at once.
    Issued at the unit's first parameter gradient, once the previous unit's reduce-scatter
    has landed, so its buffers and the two gathered units never live at once."""
    BACKWARD_POST = "post"
    """After this unit's gradients are computed (and its reduce-scatter issued)."""


def _floating(name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"MixedPrecision.{name} must be a floating torch.dtype or None, got {dtype!r}")


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of a step (torch FSDP's ``MixedPrecision``). Master shards and optimizer state stay as they are.

    Each dtype left ``None`` keeps the tensors' own. A lower ``param_dtype`` halves the
    gathered units' memory and the all-gathers' bytes; a lower ``reduce_dtype`` halves the
    reduce-scatters'.

    Attributes:
        param_dtype: units are gathered and computed in it (a bf16 gather sends half the
            bytes).
        reduce_dtype: gradients are reduce-scattered in it (default: ``param_dtype``).
        buffer_dtype: floating buffers are kept in it.
        output_dtype: the forward's floating outputs are cast to it.
        cast_forward_inputs: floating tensors passed to the forward, and to each unit's
            forward, are cast to ``param_dtype`` (FSDP2's ``cast_forward_inputs``).

    Raises:
        TypeError: if a dtype is neither ``None`` nor a floating ``torch.dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            _floating(name, getattr(self, name))

    @property
    def reduce(self) -> torch.dtype | None:
        """The dtype gradients are reduce-scattered in: ``reduce_dtype``, else ``param_dtype``."""
        return self.reduce_dtype or self.param_dtype

    # Every cast mixed precision makes, in one place.

    def gathered(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a unit of ``dtype`` is gathered and computed in.

        Args:
            dtype: the unit's own (its shards') dtype.

        Returns:
            ``param_dtype`` for a floating ``dtype``, else ``dtype`` (an integer or bool
            parameter is never cast).
        """
        return self.param_dtype if self.param_dtype is not None and dtype.is_floating_point else dtype

    def reduced(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is reduce-scattered in.

        Args:
            dtype: the gradient's own dtype.

        Returns:
            ``reduce``, else ``dtype``.
        """
        return self.reduce or dtype

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Cast the forward's floating inputs to ``param_dtype`` (with ``cast_forward_inputs``).

        Args:
            args: the forward's positional arguments (any pytree).
            kwargs: the forward's keyword arguments (any pytree).

        Returns:
            ``(args, kwargs)`` with every floating tensor cast (new tensors); unchanged
            without ``param_dtype`` or ``cast_forward_inputs``.
        """
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        return _cast_floating((args, kwargs), self.param_dtype)  # type: ignore[no-any-return]

    def cast_output(self, out: Any) -> Any:
        """Cast the forward's floating outputs to ``output_dtype``.

        Args:
            out: what the forward returned (any pytree).

        Returns:
            ``out`` with every floating tensor cast; unchanged without ``output_dtype``.
        """
        return out if self.output_dtype is None else _cast_floating(out, self.output_dtype)

    def buffer(self, t: torch.Tensor) -> torch.dtype:
        """The dtype a buffer is kept in.

        Args:
            t: the buffer.

        Returns:
            ``buffer_dtype`` for a floating buffer when set, else the buffer's own dtype.
        """
        return self.buffer_dtype if self.buffer_dtype is not None and t.is_floating_point() else t.dtype


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return torch_pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


@dataclass(frozen=True)
class CPUOffload:
    """Keep shards, gradients and optimizer state on the CPU; compute on ``device``.

    Each unit is copied to ``device`` just for its gather, and the optimizer steps on the
    CPU (the seed's ``CPUOffload(offload_params=True)``). Memory on the device: the units
    in flight and the activations; each use costs a host-to-device copy of the unit's
    shard before its all-gather, and each reduced gradient shard a copy back to the CPU.

    Attributes:
        offload_params: offload the shards (the seed's flag; always ``True`` here).
        device: where the model computes (default: the current CUDA device when there is
            one, else the CPU).
    """

    offload_params: bool = True
    device: torch.device | str | None = None

    def compute_device(self) -> torch.device:
        """The device the model computes on.

        Returns:
            ``device``, or the current CUDA device when there is one, else the CPU.

        Raises:
            ValueError: if ``device`` is a CUDA device that does not exist here, or is not a
                CPU or accelerator device.
        """
        if self.device is None:
            return (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        device = torch.device(self.device)
        if device.type == "cuda" and (
            not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
        ):
            raise ValueError(
                f"CPUOffload device {device} does not exist here "
                f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices)"
            )
        if device.type not in ("cpu", "cuda", "xpu", "mps"):
            raise ValueError(f"CPUOffload device {device}: compute needs a cpu or accelerator device")
        return device


@dataclass(frozen=True)
class Schedule:
    """When things happen in a step, as one value, the same on every rank.

    When and in what dtype units are gathered and where they live, when gradients are
    reduce-scattered and when the optimizer runs. To accumulate over calls instead of
    micro-batches, chain ``accumulate(k, optimizer)``.

    Attributes:
        reshard_after_forward: ``False`` keeps each unit gathered from its forward to its
            backward (one all-gather less per unit, more memory: ZeRO-2 /
            ``SHARD_GRAD_OP``). ``True``: freed after its forward, gathered again for its
            backward.
        backward_prefetch: when the next unit's all-gather is issued in backward
            (``BACKWARD_PRE``, ``BACKWARD_POST``, ``None``: when it is needed), overlapping
            it with compute.
        forward_prefetch: issue the next unit's all-gather in forward before it runs,
            overlapping it with compute.
        max_inflight: caps the gathered non-root units at that many times the largest
            one's bytes (prefetch included), so prefetching goes on past small units; at
            least 1.
        keep_tail_gathered: with ``reshard_after_forward``, the unit that ran last stays
            gathered for its backward, which comes first; with this (and a backward
            prefetch) so do the units before it while they fit the in-flight cap: one
            all-gather, and its wait, less for each, their bytes held through the loss
            (``False``: the last unit alone, the least memory at backward's start).
        mixed_precision: the step's dtypes (``MixedPrecision``).
        cpu_offload: shards, gradients and optimizer state on the CPU (``CPUOffload``);
            ``None``: they live where the shards are.
        update_in_backward: step each unit's optimizer as soon as its gradient shard is
            reduce-scattered, so the gradient shards of all units never live at once (the
            optimizer must then be elementwise: no link that needs the whole gradient).
        micro_batches: ``N`` makes a step's batch a sequence of N micro-batches whose
            gradients are averaged.
        reduce_each_micro_batch: ``True`` reduce-scatters each micro-batch's gradients
            (memory: gradient shards); ``False`` keeps every unit's full gradient across
            the micro-batches and reduce-scatters once (torch's ``no_sync``: a full
            gradient per unit, one reduce-scatter per unit per step).

    Raises:
        ValueError: if ``max_inflight`` or ``micro_batches`` is not a whole number >= 1,
            ``update_in_backward`` is asked with more than one micro-batch, or
            ``cpu_offload``'s device does not exist here.
        TypeError: if ``backward_prefetch``, ``mixed_precision`` or ``cpu_offload`` is not
            of its type.
    """

    reshard_after_forward: bool = True
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = True
    max_inflight: int = 2  # gathered bytes at once, in largest non-root units, prefetches included
    keep_tail_gathered: bool = True
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    cpu_offload: CPUOffload | None = None
    update_in_backward: bool = False
    micro_batches: int = 1
    reduce_each_micro_batch: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_inflight, bool) or not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1 (the unit that runs), got {self.max_inflight!r}")
        if self.backward_prefetch is not None and not isinstance(self.backward_prefetch, BackwardPrefetch):
            raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {self.backward_prefetch!r}")
        if not isinstance(self.mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a MixedPrecision, got {type(self.mixed_precision).__name__}")
        if self.cpu_offload is not None:
            if not isinstance(self.cpu_offload, CPUOffload):
                raise TypeError(f"cpu_offload must be a CPUOffload or None, got {type(self.cpu_offload).__name__}")
            self.cpu_offload.compute_device()  # fails now, naming the device, if it does not exist
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches must be a whole number >= 1, got {self.micro_batches!r}")
        if self.update_in_backward and self.micro_batches > 1:
            raise ValueError(
                f"Schedule(update_in_backward=True, micro_batches={self.micro_batches}): updating each unit during "
                "backward would step it once per micro-batch; give it one batch per step (micro_batches=1), or "
                "leave update_in_backward off"
            )

    def gather_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a unit of ``dtype`` is gathered in (``MixedPrecision.gathered``).

        Args:
            dtype: the unit's own dtype.

        Returns:
            ``mixed_precision.param_dtype`` for a floating ``dtype``, else ``dtype``.
        """
        return self.mixed_precision.gathered(dtype)

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is reduce-scattered in (``MixedPrecision.reduced``).

        Args:
            dtype: the gradient's own dtype.

        Returns:
            ``mixed_precision.reduce``, else ``dtype``.
        """
        return self.mixed_precision.reduced(dtype)
