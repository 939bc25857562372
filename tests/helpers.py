"""Plain helpers shared by test modules (fixtures live in conftest.py).

Test modules import these from here rather than from each other or from conftest.py: importing a
test module runs its module-level setup and ties one file's helpers to another file's tests, and
pytest owns conftest.py's import. Heavy imports (jax, torch, transformers) stay inside the helpers
so that a SQL test importing this module does not pay for them.
"""
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def spider_dir() -> pathlib.Path:
    """Spider data lives outside the repo (../shared/data/spider, or $CAPER_SPIDER_DIR)."""
    return pathlib.Path(os.environ.get("CAPER_SPIDER_DIR", REPO.parent / "shared" / "data" / "spider"))


def require(path: pathlib.Path) -> pathlib.Path:
    """Returns path if it exists; fails under CI (CI=true), skips elsewhere."""
    if path.exists():
        return path
    message = f"missing test data: {path} (set CAPER_SPIDER_DIR)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)
