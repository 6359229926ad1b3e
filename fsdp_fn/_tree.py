"""Pytree helpers: optree's that see through ``Sharded`` (registered under the optree namespace
``"fsdp_fn"``), and torch's that also open dataclass instances (a module's outputs)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

NAMESPACE = "fsdp_fn"  # optree namespace under which ``Sharded`` is a pytree node


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` that sees through ``Sharded``.

    A ``Sharded`` node's shards are leaves and its layout and ``received`` are structure,
    so mapping over gradients or moments gives a ``Sharded`` of the same layout. No
    communication; memory: what ``fn`` makes.

    Args:
        fn: ``fn(leaf, *leaves_of_rest) -> new leaf``.
        tree: the pytree to map over (``Sharded`` nodes, tuples, dicts, named tuples, ...).
        *rest: pytrees of ``tree``'s structure, whose leaves are passed to ``fn`` beside
            ``tree``'s.

    Returns:
        A pytree of ``tree``'s structure with ``fn``'s results as leaves.
    """
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    """``optree.tree_leaves`` that sees through ``Sharded``.

    Args:
        tree: any pytree; a ``Sharded`` node's leaves are its shards, in plan order.

    Returns:
        The leaves, in tree order (``None`` is no leaf, as in optree).
    """
    return optree.tree_leaves(tree, namespace=NAMESPACE)  # type: ignore[no-any-return]


# --- torch pytrees that open dataclasses -----------------------------------------------------------


class _Opened:
    """A dataclass instance that torch's pytree does not know, opened into its fields. Its
    pytree context, the fields' names and a copy of the instance with its fields cleared (the
    class, any other attribute), keeps none of the fields' tensors alive."""

    __slots__ = ("context", "fields")

    def __init__(self, instance: Any) -> None:
        names = tuple(f.name for f in dataclasses.fields(instance))
        self.fields = [open_dataclasses(getattr(instance, name)) for name in names]
        shell = copy.copy(instance)
        for name in names:
            object.__setattr__(shell, name, None)  # (frozen dataclasses too)
        self.context = (names, shell)


def _closed(fields: Any, context: tuple[tuple[str, ...], Any]) -> Any:
    names, shell = context
    instance = copy.copy(shell)
    for name, value in zip(names, fields, strict=True):
        object.__setattr__(instance, name, value)
    return instance


torch_pytree.register_pytree_node(_Opened, lambda node: (node.fields, node.context), _closed)


def open_dataclasses(tree: Any) -> Any:
    """``tree`` with every dataclass instance that torch's pytree keeps whole (a leaf) opened
    into its fields, recursively; torch's own nodes (tuples, dicts, a Hugging Face
    ``ModelOutput``) stay as they are. Copies no tensor."""
    return torch_pytree.tree_map(
        lambda x: _Opened(x) if dataclasses.is_dataclass(x) and not isinstance(x, type) else x, tree
    )


def flatten(tree: Any) -> tuple[list[Any], torch_pytree.TreeSpec]:
    """``torch.utils._pytree.tree_flatten`` that also sees through dataclass instances (as
    torch's FSDP1 finds the tensors in a module's outputs); ``unflatten`` rebuilds them."""
    return torch_pytree.tree_flatten(open_dataclasses(tree))


def unflatten(leaves: list[Any], spec: torch_pytree.TreeSpec) -> Any:
    """The tree ``flatten`` took apart, with ``leaves`` in its leaves' places."""
    return torch_pytree.tree_unflatten(leaves, spec)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``: torch's pytree nodes and dataclass instances are opened."""
    if type(tree) is torch.Tensor:  # (a unit's usual output: no flatten)
        return [tree]
    return [x for x in flatten(tree)[0] if isinstance(x, torch.Tensor)]
