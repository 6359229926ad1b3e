"""Saving policies: which intermediate results of a rematerialised region its forward keeps.

>>> save_dots.saves(torch.ops.aten.mm.default), save_nothing.saves(torch.ops.aten.mm.default)
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class SavePolicy:
    """Which intermediate results of a rematerialised region the forward keeps.

    The recomputation takes the kept outputs instead of running their operators again, so
    it costs fewer flops and the forward keeps more memory. No communication.

    Args:
        name: the policy's name, shown in its repr and in errors.
        ops: the aten operators (``torch.ops.aten.mm`` or one overload of it) whose
            outputs are kept. Empty: keep nothing but the inputs (full rematerialisation).

    Raises:
        TypeError: if an entry of ``ops`` is not an aten operator (packet or overload).

    Examples:
        >>> SavePolicy("save_mm", frozenset({torch.ops.aten.mm})).saves(torch.ops.aten.mm.default)
        True
    """

    name: str
    ops: frozenset[Any] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        bad = [op for op in self.ops if not isinstance(op, torch._ops.OpOverloadPacket | torch._ops.OpOverload)]
        if bad:
            raise TypeError(
                f"SavePolicy {self.name!r}: ops must be aten operators such as torch.ops.aten.mm, got {bad!r}"
            )

    def saves(self, func: Any) -> bool:
        """Whether the forward keeps the outputs of ``func``.

        Args:
            func: an aten operator overload (``torch.ops.aten.mm.default``), as a dispatch
                mode sees it.

        Returns:
            ``True`` when ``func``, or the operator it is an overload of, is in ``ops``.
        """
        return func in self.ops or func.overloadpacket in self.ops


save_nothing = SavePolicy("save_nothing")
"""Keep only the region's inputs; recompute everything (``jax.checkpoint``'s default)."""


save_dots = SavePolicy(
    "save_dots",
    frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_dot_product_flash_attention_for_cpu}),
)
"""Keep the outputs of matrix multiplications (``nn.Linear`` lowers to ``mm``/``addmm``)
and of CPU fused attention; recompute the cheap element-wise rest (JAX's
``dots_saveable``, torchtitan's op-level selective activation checkpointing)."""
