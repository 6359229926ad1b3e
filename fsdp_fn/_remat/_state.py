"""A module's parameters and buffers as inputs of a region: found where they sit, put in place for a call.

>>> tensors, slots = _state_slots([nn.Linear(2, 3)])
>>> [(tuple(t.shape), [attr for _, attr, _ in places]) for t, places in zip(tensors, slots)]
[((3, 2), ['weight']), ((3,), ['bias'])]
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fsdp_fn._functional import entries_set
from fsdp_fn._standin import StandIn


def _state_slots(modules: Sequence[nn.Module]) -> tuple[list[torch.Tensor], list[list[tuple[nn.Module, str, bool]]]]:
    """The modules' current parameter and buffer tensors (each once) and where each one sits."""
    tensors: list[torch.Tensor] = []
    slots: list[list[tuple[nn.Module, str, bool]]] = []
    index: dict[int, int] = {}
    seen: set[tuple[int, str]] = set()
    for root in modules:
        for m in root.modules():
            for table, is_param in ((m._parameters, True), (m._buffers, False)):
                for attr, t in table.items():
                    # a stand-in for a parameter that is not there (another unit's, not gathered)
                    if not isinstance(t, torch.Tensor) or isinstance(t, StandIn) or (id(m), attr) in seen:
                        continue
                    seen.add((id(m), attr))
                    k = index.setdefault(id(t), len(tensors))
                    if k == len(tensors):
                        tensors.append(t)
                        slots.append([])
                    slots[k].append((m, attr, is_param))
    return tensors, slots


def _installed(
    slots: list[list[tuple[nn.Module, str, bool]]], tensors: Sequence[torch.Tensor]
) -> contextlib.AbstractContextManager[None]:
    """The modules' parameters and buffers are ``tensors`` for the block (restored after it)."""
    return entries_set(
        (m._parameters if is_param else m._buffers, attr, t)
        for places, t in zip(slots, tensors, strict=True)
        for m, attr, is_param in places
    )


class _Opaque:
    """A value pytrees treat as one constant leaf (the module slots must not be flattened)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value
