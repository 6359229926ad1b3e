"""When the backward of a unit with frozen parameters alone is done.

Such a unit gets no gradient, so no ``GatherUnit`` backward marks the end of its backward.
Its inputs' gradients do, when every path of autograd's graph from its outputs goes back
through its inputs: each of its backward nodes that runs has then run. A unit that reads
some other tensor that needs a gradient (a closure, a tensor kept on a module, another
unit's parameter) is not watched: it stays gathered until the backward ends.

torch's FSDP2 marks the end with an identity ``autograd.Function`` on the inputs, which
forbids in-place changes to them inside the module; hooks on the inputs' gradients do not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook

from fsdp_fn._tree import tensors_in


def needing_grad(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` (any pytree; dataclass instances are opened) that need a gradient."""
    return [t for t in tensors_in(tree) if t.requires_grad]


class InputsWatch:
    """Calls ``done`` once the gradients of a unit's inputs are computed in a backward.

    Made before the unit's forward runs (hooks registered then see the inputs as they came
    in, even if the forward changes them in place); ``keep_if_closed`` after it, on its
    outputs, cancels the watch when the outputs' graph reaches anything but those inputs.

    >>> x = torch.ones(3, requires_grad=True) * 2
    >>> done = []
    >>> watch = InputsWatch.of((x,), lambda: done.append("x"))
    >>> y = x.mul_(3).sum()  # the unit's forward: changes its input in place
    >>> watch.keep_if_closed([y])
    >>> y.backward()
    >>> done
    ['x']
    >>> w, kept = torch.ones(3, requires_grad=True) * 2, torch.ones(3, requires_grad=True)
    >>> watch = InputsWatch.of((w,), lambda: done.append("w"))
    >>> y = (w * kept).sum()
    >>> watch.keep_if_closed([y])  # ``kept`` reaches the output too: the watch is cancelled
    >>> y.backward()
    >>> done
    ['x']
    """

    def __init__(self, inputs: Sequence[torch.Tensor], done: Callable[[], None]) -> None:
        self.inputs = {get_gradient_edge(t).node for t in inputs}
        self.first = torch._C._autograd._get_sequence_nr()  # nodes made from here on are the unit's
        self.handle = register_multi_grad_hook(inputs, lambda _grads: done())

    @classmethod
    def of(cls, args: Any, done: Callable[[], None]) -> InputsWatch | None:
        """A watch over the tensors in ``args`` that need a gradient; None when there are none."""
        inputs = needing_grad(args)
        return cls(inputs, done) if inputs else None

    def keep_if_closed(self, outputs: Sequence[torch.Tensor]) -> None:
        """Walk autograd's graph from the unit's ``outputs`` that need a gradient (cost: one visit
        per node the forward made); cancel the watch when a path leaves the unit other than
        through its inputs."""
        end = torch._C._autograd._get_sequence_nr()
        stack: list[Any] = [get_gradient_edge(t).node for t in outputs]
        seen: set[Any] = set()
        while stack:
            node = stack.pop()
            if node is None or node in self.inputs or node in seen:
                continue
            seen.add(node)
            # Made before the forward, or a leaf's accumulator (numbered last): outside the unit.
            if not self.first <= node._sequence_nr() < end:
                self.handle.remove()
                return
            stack.extend(next_node for next_node, _ in node.next_functions)
