"""Allocation labels: what a storage allocated inside a block counts as, for the meters running.

A leaf module: the code that allocates (collectives, a unit's lifecycle, the gradient
sink) labels its buffers here without importing the meter; the meter reads the label
stack and registers itself in ``active`` while it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch


class Meter(Protocol):
    def _register(self, t: torch.Tensor, category: str, override: bool) -> None: ...


_labels: list[str] = []
active: list[Meter] = []  # the meters running now, innermost last


@contextlib.contextmanager
def label(category: str) -> Iterator[None]:
    """Storages allocated inside the block count as ``category`` (cheap when no meter runs).

    >>> with label("comm"):
    ...     current()
    'comm'
    >>> current()
    'activations'
    """
    _labels.append(category)
    try:
        yield
    finally:
        _labels.pop()


def current(default: str = "activations") -> str:
    """The innermost label, or ``default`` outside any ``label`` block."""
    return _labels[-1] if _labels else default


def retag(t: torch.Tensor, category: str) -> None:
    """Count ``t``'s storage as ``category`` in every running meter (no-op when none runs)."""
    for meter in active:
        meter._register(t, category, override=True)
