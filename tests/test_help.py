"""``--help`` of every command prints its docstring and flags; absl writes the module docstring as is."""
import ast
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO

COMMANDS = ["caper_jax.train", "caper_jax.evaluate", "caper_jax.verify", "caper_jax.convert", "caper_jax.annotate",
            "caper_jax.upgrade_run"]


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints_the_usage(module):
    """`python -m caper_jax.annotate --help` crashed with UnicodeEncodeError: its docstring held a lone
    surrogate (an unescaped ``\\ud800``) that stdout cannot encode."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode in (0, 1), proc.stderr[-3000:]   # absl's --help exits 1 after printing the usage
    first_line = ast.get_docstring(ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())).splitlines()[0]
    assert first_line in proc.stdout


def test_every_docstring_can_be_printed():
    """Every module docstring (what absl prints for --help) encodes as UTF-8."""
    for path in sorted(pathlib.Path(REPO).glob("caper_jax/**/*.py")) + sorted(pathlib.Path(REPO).glob("configs/*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        docstring.encode("utf-8")   # raises on a lone surrogate
