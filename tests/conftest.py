"""Shared fixtures. Spider data lives outside the repo (../shared/data/spider, or $CAPER_SPIDER_DIR).

Where a test needs the data and CI=true, a missing file is a failure, not a skip. Plain helpers are
in tests/helpers.py.
"""
import pytest

from tests.helpers import require, spider_dir


@pytest.fixture(scope="session")
def spider():
    """Path of the Spider dev data (dev.json, tables.json, database/<db>/<db>.sqlite)."""
    root = require(spider_dir())
    require(root / "dev.json")
    return root
