"""pyproject.toml: the wheel holds caper_jax and configs (not tests/ or bench/), and its dependency
metadata is requirements.txt pin for pin, with the `test` extra equal to what
requirements-test.txt adds."""
import shutil
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement

from tests.helpers import REPO


def requirement_lines(path) -> list[str]:
    """The requirement lines of a pip requirements file: no comments, no `-r` includes."""
    lines = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            lines.append(line)
    return lines


def normalised(requirements) -> set[str]:
    return {str(Requirement(r)) for r in requirements}


def test_wheel_contents_and_dependencies_follow_the_requirements_files(tmp_path):
    # Built from a copy: pip builds in the source tree and would leave build/ and *.egg-info there.
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "requirements.txt", "requirements-test.txt"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("caper_jax", "configs", "tests", "bench"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    # No build isolation: the venv's setuptools, no index needed.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--wheel-dir", str(tmp_path / "dist"), str(src)], check=True)
    (wheel,) = (tmp_path / "dist").glob("caper_jax-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = [line.split(": ", 1) for line in zf.read(metadata).decode().splitlines() if ": " in line]

    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"caper_jax", "configs"}
    assert "caper_jax/sql/clauses.py" in names and "configs/prm.py" in names and "configs/common.py" in names
    shipped = {n.removesuffix(".py").replace("/", ".") for n in names if n.endswith(".py")}
    local = {p.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")
             for top in ("caper_jax", "configs") for p in (REPO / top).rglob("*.py")}
    assert shipped == local, "every module of caper_jax/ and configs/ is in the wheel"

    runtime = [v for k, v in fields if k == "Requires-Dist" and "extra ==" not in v]
    test_extra = [v.split(";")[0].strip() for k, v in fields if k == "Requires-Dist" and 'extra == "test"' in v]
    assert normalised(runtime) == normalised(requirement_lines(REPO / "requirements.txt"))
    test_only = set(requirement_lines(REPO / "requirements-test.txt")) - set(requirement_lines(REPO / "requirements.txt"))
    assert normalised(test_extra) == normalised(test_only)
