"""Shared fixtures. Spider data lives outside the repo (../shared/data/spider, or $CAPER_SPIDER_DIR).

Where a test needs the data and CI=true, a missing file is a failure, not a skip. Plain helpers are
in tests/helpers.py.
"""
import os
import sys

import pytest

from tests.helpers import require, spider_dir

# XLA:CPU compiles dominate this suite (every tiny model, shape and config compiles anew) while the
# compiled programs run for milliseconds: with jax_disable_most_optimizations (XLA backend optimisation
# level 0, no expensive LLVM passes) a compile takes about half the time (the tiny model's gradient:
# 15 s -> 8.6 s of CPU) and the fast loop about 55 % of its CPU time. The programs compute the same
# functions; the whole suite passes with and without it. Set here, before jax is imported, so that the
# trainers' and CLIs' subprocesses inherit it; JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite with
# XLA's full optimisation.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "jax" in sys.modules:   # imported by a plugin before this file: the environment came too late
    sys.modules["jax"].config.update("jax_disable_most_optimizations",
                                     os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1")


@pytest.fixture(scope="session")
def spider():
    """Path of the Spider dev data (dev.json, tables.json, database/<db>/<db>.sqlite)."""
    root = require(spider_dir())
    require(root / "dev.json")
    return root
