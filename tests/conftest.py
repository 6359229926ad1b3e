import os

import pytest
from hypothesis import settings

from fsdp_fn.testing import RankPool

# Every rank must draw the same examples: a deterministic profile, here and in the ranks.
settings.register_profile("fsdp_fn", derandomize=True, database=None, deadline=None, print_blob=False)
settings.load_profile("fsdp_fn")

POOL_WORLD = 4


@pytest.fixture(scope="session")
def pool():
    """Four gloo ranks, spawned once; tests run on ranks 0..W-1 with a group of exactly W."""
    with RankPool(POOL_WORLD, timeout=float(os.environ.get("FSDP_FN_TEST_TIMEOUT", 300))) as p:
        yield p
