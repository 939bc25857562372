"""Shared fixtures. Spider data lives outside the repo (../shared/data/spider, or $CAPER_SPIDER_DIR).

Where a test needs the data and CI=true, a missing file is a failure, not a skip.
"""
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def spider_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CAPER_SPIDER_DIR", REPO.parent / "shared" / "data" / "spider"))


def require(path: pathlib.Path) -> pathlib.Path:
    """Returns path if it exists; fails under CI, skips elsewhere."""
    if path.exists():
        return path
    message = f"missing test data: {path} (set CAPER_SPIDER_DIR)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def spider():
    """Path of the Spider dev data (dev.json, tables.json, database/<db>/<db>.sqlite)."""
    root = require(spider_dir())
    require(root / "dev.json")
    return root
