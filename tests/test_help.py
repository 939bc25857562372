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


def unprintable_docstrings(paths) -> list[str]:
    """``path: error`` of every module docstring (what absl prints for --help) that UTF-8 cannot encode."""
    bad = []
    for path in paths:
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        try:
            docstring.encode("utf-8")   # raises on a lone surrogate
        except UnicodeEncodeError as error:
            bad.append(f"{path}: {error}")
    return bad


def test_every_docstring_can_be_printed(tmp_path):
    """Every module docstring of the package and the configs encodes as UTF-8; the check finds the commands'
    modules and flags a docstring holding a lone surrogate, as ``caper_jax/annotate.py``'s once did."""
    paths = sorted(pathlib.Path(REPO).glob("caper_jax/**/*.py")) + sorted(pathlib.Path(REPO).glob("configs/*.py"))
    assert {REPO / (m.replace(".", "/") + ".py") for m in COMMANDS} <= set(paths)
    assert unprintable_docstrings(paths) == []
    surrogate = tmp_path / "surrogate.py"
    surrogate.write_text(r'"""A lone surrogate: \ud800."""' + "\n")   # the escape, as a source file holds it
    flagged = unprintable_docstrings([surrogate])
    assert len(flagged) == 1 and flagged[0].startswith(f"{surrogate}: ") and "surrogates not allowed" in flagged[0]
