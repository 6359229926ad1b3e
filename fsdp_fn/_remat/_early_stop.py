"""Early stop: what a fully rematerialised region's recomputation may leave out.

The forward is traced (each operator, where its inputs came from, its outputs' layout); the
tail of operators whose outputs no backward reads is not run again: the recomputation hands
back empty tensors of the same layout there, as torch's non-reentrant checkpoint does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from fsdp_fn._remat._errors import RematError
from fsdp_fn._remat._modes import _Checked, _Forward

aten = torch.ops.aten


# Operators whose backward reads none of their inputs' or outputs' values (only shapes), and
# those that read some inputs (by position) but not their outputs. Any other operator is
# assumed to read every input and output: leaving out less is always safe.
# Views cost nothing and always run; their order relative to other operators may differ
# between a forward without grad and the recomputation with it (``linear``'s ``t`` and ``view``).
_VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.t.default,
        aten.transpose.int,
        aten.split.Tensor,
        aten.permute.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.slice.Tensor,
        aten.select.int,
        aten.alias.default,
        aten.detach.default,  # plain autograd's recomputation may alias a tensor it saves
    }
)


_READS_NOTHING = _VIEWS | {aten.add.Tensor, aten.sub.Tensor}


_READS_INPUTS = {aten.addmm.default: (1, 2), aten.mm.default: (0, 1)}


@dataclass(frozen=True)
class _Empty:
    """The layout of an operator's output: an uninitialised tensor like it stands in for it."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def like(t: torch.Tensor) -> _Empty:
        return _Empty(t.shape, t.stride(), t.dtype, t.device)

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


def _opaque(x: Any) -> Any:
    """A non-tensor output as a layout keeps it: a number or ``None`` itself, any other object
    (a collective's work handle) not at all."""
    return x if x is None or isinstance(x, bool | int | float | str | torch.dtype) else None


class _Trace(_Forward):
    """Forward of a fully rematerialised region: each operator, which earlier operators its
    tensor inputs came from, and its outputs' layout (no tensor is held)."""

    def __init__(self, inputs: Sequence[torch.Tensor], state: int = 0) -> None:
        super().__init__(inputs, state)
        self.ops: list[tuple[Any, list[list[int]], Any]] = []  # (op, producers of each input, output layout)
        self.producer: dict[int, int] = {}  # id(tensor) -> index of the op that made it (the latest with that id)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        self.copy_before_write(func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # metadata queries (fake tensors): not operators of the region
            return out
        inputs = [
            [self.producer[id(t)]] if isinstance(t, torch.Tensor) and id(t) in self.producer else []
            for t in torch_pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        ]
        self.note(func, args, kwargs, out)
        # (a layout only: a collective's work handle, which holds its tensors, is not kept)
        layout = torch_pytree.tree_map(lambda x: _Empty.like(x) if isinstance(x, torch.Tensor) else _opaque(x), out)
        index = len(self.ops)
        self.ops.append((func, inputs, layout))
        for t in torch_pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.producer[id(t)] = index
        return out

    def tail(self) -> tuple[list[tuple[Any, Any]], int]:
        """The region's operators other than views (each with its outputs' layout) and how
        many of them run before the tail whose outputs no backward reads: from there on, the
        recomputation may return empty tensors (torch's early stop); all of them: no such tail."""
        must: set[int] = set()
        for i, (op, inputs, _) in enumerate(self.ops):
            random = torch.Tag.nondeterministic_seeded in op.tags
            if op._schema.is_mutable or random or (op not in _READS_NOTHING and op not in _READS_INPUTS):
                must.add(i)  # reads its outputs (or may): it runs, and so does what feeds it
                must.update(p for ps in inputs for p in ps)
            elif op in _READS_INPUTS:
                must.update(p for k in _READS_INPUTS[op] if k < len(inputs) for p in inputs[k])
        todo = list(must)
        while todo:  # what a running operator reads must run too
            for p in (p for ps in self.ops[todo.pop()][1] for p in ps):
                if p not in must:
                    must.add(p)
                    todo.append(p)
        start = max(must, default=-1) + 1
        kept = [(op, layout) for op, _, layout in self.ops if op not in _VIEWS]
        before = sum(op not in _VIEWS for op, _, _ in self.ops[:start])
        return kept, before


class _SkipTail(_Checked):
    """Recomputation: run the operators up to the tail as the forward did; for the tail,
    whose outputs no backward reads, return empty tensors of the same layout. Views always
    run (counted apart: their order may differ)."""

    def __init__(self, ops: Sequence[tuple[Any, Any]], start: int, forward: _Forward | None, where: str) -> None:
        super().__init__(forward, where)
        self.ops, self.start, self.at, self.same = ops, start, 0, True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        if func in _VIEWS or func.namespace == "prim":  # views; metadata queries (fake tensors)
            return func(*args, **(kwargs or {}))
        self.check(func, args, kwargs)
        at, self.at = self.at, self.at + 1
        expected = self.ops[at][0] if at < len(self.ops) else None
        if at < self.start:
            self.same = self.same and expected == func
            return func(*args, **(kwargs or {}))
        if not self.same:  # lowered to other operators than the forward's (under a transform): skip nothing
            return func(*args, **(kwargs or {}))
        if expected != func:
            raise RematError(
                f"remat({self.where}): the recomputation ran {func} where the forward ran {expected} (operator "
                f"#{at}), after the operators the backward reads: the region must run the same operators when it "
                "is recomputed"
            )
        return torch_pytree.tree_map_only(_Empty, _Empty.make, self.ops[at][1])
