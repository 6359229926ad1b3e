"""Every docstring example in the package runs (inside a real rank, where examples need one)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import fsdp_fn
from fsdp_fn.testing import RankPool

MODULES = sorted(m.name for m in pkgutil.walk_packages(fsdp_fn.__path__, "fsdp_fn."))  # subpackages too

# Modules with no docstring example, and why. Every other module must run at least one example,
# so a module whose examples were deleted (or never collected) fails instead of passing with none.
NO_EXAMPLES = {
    "fsdp_fn._agree": "internal: ranks agree on a value; shows nothing on one rank (test_errors.py)",
    "fsdp_fn._guard": "internal: the step's watchdog; needs several ranks to show anything (test_reliability.py)",
    "fsdp_fn._group": "internal: resolves a group or mesh into process groups",
    "fsdp_fn._tree": "tree_map: runnable example in docs/api.md (test below)",
    "fsdp_fn._errors": "exception classes; raised and matched in test_reliability.py and test_errors.py",
    "fsdp_fn._predict": "predict_collectives and estimate_memory: runnable examples in docs/api.md (test below)",
    "fsdp_fn._prefetch": "internal: which unit to gather next",
    "fsdp_fn._lookup": "internal: a lookup's rows fetched from their holders; needs several ranks (test_lookup.py)",
    "fsdp_fn._runtime": "internal: one call of a module over shards; apply_sharded's example is in _composable",
    "fsdp_fn._lean": "internal: the train step's own pass; needs a step around it to show anything",
    "fsdp_fn._wiring": "internal: what a call over shards needs that is the same at every call",
    "fsdp_fn._sink": "internal: where a unit's full gradient goes after its backward",
    "fsdp_fn._unit": "internal: a unit's lifecycle; needs a step around it to show anything",
    "fsdp_fn._gather": "gather_for: runnable example in docs/api.md (test below)",
    "fsdp_fn._init": "init_shards: runnable example in docs/api.md (test below)",
    "fsdp_fn._policy": "plain option dataclasses; used by the examples in docs/features.md (test below)",
    "fsdp_fn._step": "train_step: runnable examples in docs/api.md and docs/features.md (test below)",
    "fsdp_fn._unfrozen": "train_unfrozen: runnable example in docs/api.md (test below)",
    "fsdp_fn._planner": "measure_costs times real steps on several ranks (test_planner.py, bench/planner.py)",
    "fsdp_fn.testing": "its example spawns ranks, so it is +SKIP; RankPool runs every multi-rank test",
    "fsdp_fn.testing._pool": "RankPool spawns ranks; every multi-rank test runs it",
    "fsdp_fn.testing._parity": "assert_matches_unsharded: runnable example in docs/testing-your-model.md (test below)",
    "fsdp_fn.checkpoint": "the package's names; examples in its modules and docs/checkpoints.md (test below)",
    "fsdp_fn.checkpoint._export": "safetensors export and import: examples in docs/checkpoints.md (test below)",
    "fsdp_fn.checkpoint._save": "save: runnable examples in docs/checkpoints.md (test below)",
    "fsdp_fn.checkpoint._load": "load: runnable examples in docs/checkpoints.md (test below)",
    "fsdp_fn.checkpoint._background": "blocking=False saves: in docs/checkpoints.md (test below)",
    "fsdp_fn.checkpoint._manager": "CheckpointManager: runnable example in docs/checkpoints.md (test below)",
    "fsdp_fn.checkpoint._entries": "internal: a TrainState's DCP entries; needs a sharded state (test_checkpoint.py)",
    "fsdp_fn.checkpoint._opt_state": "internal: optimizer-state names; needs a sharded state (test_checkpoint.py)",
    "fsdp_fn.checkpoint._per_rank": "internal: RNG states and buffers that differ; needs ranks (test_checkpoint.py)",
    "fsdp_fn._remat": "the package's names; remat's example is in fsdp_fn._remat._function",
    "fsdp_fn.tp": "the package's names; examples in fsdp_fn._tp, fsdp_fn._tp_plan and docs/features.md (test below)",
    "fsdp_fn._remat._errors": "the exception class; raised and matched in test_remat.py",
    "fsdp_fn._remat._early_stop": "internal: the tail a recomputation leaves out; test_remat.py (stops early)",
}


def _doctest(group, name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    return result.failed, result.attempted


@pytest.fixture(scope="module")
def solo():
    """One rank whose default group is itself, as the examples assume."""
    with RankPool(1) as p:
        yield p


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(solo, name):
    # Catches: a failing example, and a module whose examples silently stopped running.
    failed, attempted = solo.run(_doctest, name)[0]
    assert failed == 0, f"{failed} of {attempted} examples failed in {name}"
    if name in NO_EXAMPLES:
        assert attempted == 0, f"{name} has examples now: take it off NO_EXAMPLES"
    else:
        assert attempted > 0, f"{name} has no docstring example: add one, or list it in NO_EXAMPLES with why"


def _markdown_blocks(group, path):
    import pathlib
    import re

    text = pathlib.Path(path).read_text()
    namespace: dict = {}
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{path} block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{path}: block {i + 1} failed: {type(e).__name__}: {e}") from e
    return len(blocks)


@pytest.mark.parametrize(
    "page",
    [
        "docs/getting-started.md",
        "docs/api.md",
        "docs/features.md",
        "docs/testing-your-model.md",
        "docs/checkpoints.md",
    ],
)
def test_documentation_examples_run(solo, page):
    assert solo.run(_markdown_blocks, page)[0] > 3
