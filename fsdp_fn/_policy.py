"""Runtime policies, as values: when units are gathered, in which dtype, on which device."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as torch_pytree


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued in backward (the seed's ``backward_prefetch``)."""

    BACKWARD_PRE = "pre"
    """Before computing this unit's gradients: most overlap, two units gathered at once."""
    BACKWARD_POST = "post"
    """After this unit's gradients are computed (and its reduce-scatter issued)."""


def _floating(name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"MixedPrecision.{name} must be a floating torch.dtype or None, got {dtype!r}")


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of a step (torch FSDP's ``MixedPrecision``). Master shards and optimizer state stay as they are.

    ``param_dtype``: units are gathered and computed in it (a bf16 gather sends half the
    bytes). ``reduce_dtype``: gradients are reduce-scattered in it (default:
    ``param_dtype``). ``buffer_dtype``: buffers are kept in it. ``output_dtype``: the
    forward's floating outputs are cast to it. ``cast_forward_inputs``: floating tensors
    passed to the forward are cast to ``param_dtype``.
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
        return self.reduce_dtype or self.param_dtype

    # Every cast mixed precision makes, in one place.

    def gathered(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a unit of ``dtype`` is gathered and computed in."""
        return self.param_dtype or dtype

    def reduced(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is reduce-scattered in."""
        return self.reduce or dtype

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The forward's floating inputs in ``param_dtype`` (with ``cast_forward_inputs``)."""
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        return _cast_floating((args, kwargs), self.param_dtype)  # type: ignore[no-any-return]

    def cast_output(self, out: Any) -> Any:
        """The forward's floating outputs in ``output_dtype``."""
        return out if self.output_dtype is None else _cast_floating(out, self.output_dtype)

    def buffer(self, t: torch.Tensor) -> torch.dtype:
        """The dtype a buffer is kept in."""
        return self.buffer_dtype if self.buffer_dtype is not None and t.is_floating_point() else t.dtype


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return torch_pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )


@dataclass(frozen=True)
class CPUOffload:
    """Shards, gradients and optimizer state live on the CPU; each unit is copied to
    ``device`` just for its gather, and the optimizer steps on the CPU (the seed's
    ``CPUOffload(offload_params=True)``). ``device``: where the model computes (default:
    the current CUDA device when there is one, else the CPU)."""

    offload_params: bool = True
    device: torch.device | str | None = None

    def compute_device(self) -> torch.device:
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
    """When, in what dtype and where units are gathered: a value, the same on every rank."""

    reshard_after_forward: bool = True
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = True
    max_inflight: int = 2  # non-root units gathered at once, prefetches included
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    cpu_offload: CPUOffload | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1 (the unit that runs), got {self.max_inflight!r}")
        if self.backward_prefetch is not None and not isinstance(self.backward_prefetch, BackwardPrefetch):
            raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {self.backward_prefetch!r}")
        if not isinstance(self.mixed_precision, MixedPrecision):
            raise TypeError(f"mixed_precision must be a MixedPrecision, got {type(self.mixed_precision).__name__}")
        if self.cpu_offload is not None:
            if not isinstance(self.cpu_offload, CPUOffload):
                raise TypeError(f"cpu_offload must be a CPUOffload or None, got {type(self.cpu_offload).__name__}")
            self.cpu_offload.compute_device()  # fails now, naming the device, if it does not exist

    def gather_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.mixed_precision.gathered(dtype)

    def reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.mixed_precision.reduced(dtype)
