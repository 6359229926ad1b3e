"""Pytree helpers that see through ``Sharded`` (registered under the optree namespace ``"fsdp_fn"``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

NAMESPACE = "fsdp_fn"  # optree namespace under which ``Sharded`` is a pytree node


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``optree.tree_map`` that sees through ``Sharded``."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    """``optree.tree_leaves`` that sees through ``Sharded``."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)  # type: ignore[no-any-return]
