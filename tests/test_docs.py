"""Every docstring example in the package runs (inside a real rank, where examples need one)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import fsdp_fn
from fsdp_fn.testing import RankPool

MODULES = sorted(m.name for m in pkgutil.iter_modules(fsdp_fn.__path__, "fsdp_fn."))


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
    failed, attempted = solo.run(_doctest, name)[0]
    assert failed == 0, f"{failed} of {attempted} examples failed in {name}"


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
    "page", ["docs/api.md", "docs/features.md", "docs/testing-your-model.md", "docs/checkpoints.md"]
)
def test_documentation_examples_run(solo, page):
    assert solo.run(_markdown_blocks, page)[0] > 3
