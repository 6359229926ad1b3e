"""A tensor-parallel plan as data: module-name patterns mapped to styles, and what each style splits.

Hugging Face's ``_tp_plan`` (``{"model.layers.*.self_attn.q_proj": "colwise", ...}``) is one,
as it is: ``*`` stands for one name in the module path (a layer's index). A style says which
dimension of each of the module's parameters is split over the tensor-parallel axis
(torch.chunk's pieces, as a DTensor ``Shard(dim)`` holds them: the first ranks hold
``ceil(n / size)`` rows, the last ones what is left) and which collectives its forward runs
(``_tp.py``). Nothing here communicates or allocates.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

COLWISE = "colwise"  # output features split: weight and bias on dim 0; the input is copied in
ROWWISE = "rowwise"  # input features split: weight on dim 1; the output summed over the axis, then the bias
EMBEDDING_ROWWISE = "embedding_rowwise"  # the vocabulary split: rows of the table; the output summed
COLWISE_GATHER_OUTPUT = "colwise_gather_output"  # colwise, its output gathered whole on every rank
VOCAB_PARALLEL = "vocab_parallel"  # colwise, its output (logits) left split for ``parallel_cross_entropy``
ROWWISE_SPLIT_INPUT = "rowwise_split_input"  # rowwise on a whole input: this rank's piece of it taken first
REPLICATED_WITH_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"  # whole, run on pieces: its gradient summed
# Sequence parallelism (Megatron's): between the split modules the sequence is split instead of
# repeated. A split module's input is then gathered along the sequence and a row-split output
# reduce-scattered along it.
SEQUENCE_PARALLEL = "sequence_parallel"  # whole, run on the rank's sequence piece (a norm): its gradient summed
SEQUENCE_SPLIT_INPUT = "sequence_split_input"  # the sequence of its whole input split on entry (the first layer)
REPLICATE = "replicate"  # every rank holds the whole module

STYLES = (
    COLWISE,
    ROWWISE,
    EMBEDDING_ROWWISE,
    COLWISE_GATHER_OUTPUT,
    VOCAB_PARALLEL,
    ROWWISE_SPLIT_INPUT,
    REPLICATED_WITH_GRAD_ALLREDUCE,
    SEQUENCE_PARALLEL,
    SEQUENCE_SPLIT_INPUT,
    REPLICATE,
)
# Hugging Face's other names for the same styles.
ALIASES = {"colwise_rep": COLWISE_GATHER_OUTPUT, "rowwise_rep": ROWWISE, "local_colwise": COLWISE}


def chunk_bounds(n: int, size: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank``'s piece when ``n`` rows are split over ``size`` ranks as
    ``torch.chunk`` splits them (DTensor's ``Shard``): ``ceil(n / size)`` each, the last ones short
    or empty.

    >>> chunk_bounds(509, 2, 0), chunk_bounds(509, 2, 1)
    ((0, 255), (255, 509))
    """
    step = -(-n // size)
    lo = min(rank * step, n)
    return lo, min(lo + step, n)


def _pattern(text: str) -> re.Pattern[str]:
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", text)) + "$")


@dataclass(frozen=True)
class TensorPlan:
    """Which modules are split over the tensor-parallel axis, and how; this rank's place on it.

    Attributes:
        styles: ``(pattern, style)`` pairs in the order given (the first pattern that matches
            a module's path wins); a style is one of ``STYLES``.
        axis: the mesh's name for the tensor-parallel axis.
        size: ranks along it.
        rank: this rank's place along it (which piece of each split parameter it holds).
    """

    styles: tuple[tuple[str, str], ...]
    axis: str = "tp"
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for pattern, style in self.styles:
            if style not in STYLES:
                raise ValueError(
                    f"tensor-parallel style {style!r} (for {pattern!r}) is not one fsdp_fn runs; "
                    f"the styles are {', '.join(STYLES)}"
                )
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside the axis's {self.size} ranks")

    @classmethod
    def of(cls, styles: Mapping[str, str], axis: str = "tp", size: int = 1, rank: int = 0) -> TensorPlan:
        """A plan from a ``{pattern: style}`` mapping (Hugging Face's ``model._tp_plan``).

        Raises:
            ValueError: if a style is not one of ``STYLES`` (nor a Hugging Face alias of one).
        """
        return cls(tuple((p, ALIASES.get(s, s)) for p, s in styles.items()), axis, size, rank)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the sequence is split between the split modules (a ``sequence_parallel`` or
        ``sequence_split_input`` style in the plan)."""
        return any(s in (SEQUENCE_PARALLEL, SEQUENCE_SPLIT_INPUT) for _, s in self.styles)

    def style_of(self, path: str) -> str | None:
        """The style of the module at ``path``, or ``None`` (replicated)."""
        for pattern, style in self._compiled:
            if pattern.match(path):
                return style
        return None

    def split_dim(self, path: str, attr: str, module: torch.nn.Module) -> int | None:
        """Which dimension of parameter ``attr`` of the module at ``path`` is split (``None``: replicated).

        Raises:
            ValueError: if the style does not fit the module (a style on a module that is not
                an ``nn.Linear`` or ``nn.Embedding`` of the kind it splits).
        """
        style = self.style_of(path)
        if style is None or style in (
            REPLICATE,
            REPLICATED_WITH_GRAD_ALLREDUCE,
            SEQUENCE_PARALLEL,
            SEQUENCE_SPLIT_INPUT,
        ):
            return None
        kind = torch.nn.Embedding if style == EMBEDDING_ROWWISE else torch.nn.Linear
        if not isinstance(module, kind):
            raise ValueError(
                f"tensor-parallel style {style!r} is for an nn.{kind.__name__}; module {path!r} is a "
                f"{type(module).__name__} (give it a style of its kind, or split its Linear children instead)"
            )
        if style in (ROWWISE, ROWWISE_SPLIT_INPUT):
            return 1 if attr == "weight" else None  # its bias is added once, after the sum
        return 0

    def local_shape(self, shape: tuple[int, ...], split: int | tuple[int, int] | None) -> tuple[int, ...]:
        """This rank's shape of a parameter of ``shape`` split on ``split`` (a dimension, or a
        ``ParamSpec.split``)."""
        if split is None:
            return shape
        dim = split if isinstance(split, int) else split[0]
        lo, hi = chunk_bounds(shape[dim], self.size, self.rank)
        return (*shape[:dim], hi - lo, *shape[dim + 1 :])

    def local(self, full: torch.Tensor, split: int | tuple[int, int] | None) -> torch.Tensor:
        """This rank's piece of ``full`` (a view; ``full`` itself when it is replicated), split on
        ``split`` (a dimension, or a ``ParamSpec.split``)."""
        if split is None:
            return full
        dim = split if isinstance(split, int) else split[0]
        lo, hi = chunk_bounds(full.shape[dim], self.size, self.rank)
        return full.narrow(dim, lo, hi - lo)

    def at(self, size: int, rank: int) -> TensorPlan:
        """The same styles for another place on an axis of ``size`` ranks."""
        return TensorPlan(self.styles, self.axis, size, rank)

    def fingerprint(self) -> str:
        """A short hash of the styles, the axis and its size (not the rank): every rank of the
        tensor-parallel axis must hold the same."""
        text = json.dumps([list(map(list, self.styles)), self.axis, self.size])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-able data (``from_dict`` reads it back)."""
        return {"styles": [list(s) for s in self.styles], "axis": self.axis, "size": self.size, "rank": self.rank}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorPlan:
        """The plan ``to_dict`` wrote."""
        return cls(tuple((p, s) for p, s in data["styles"]), data["axis"], data["size"], data["rank"])

    @property
    def _compiled(self) -> tuple[tuple[re.Pattern[str], str], ...]:
        found = _COMPILED.get(self.styles)
        if found is None:
            found = _COMPILED[self.styles] = tuple((_pattern(p), s) for p, s in self.styles)
        return found


_COMPILED: dict[tuple[tuple[str, str], ...], tuple[tuple[re.Pattern[str], str], ...]] = {}
