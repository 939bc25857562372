"""caper_jax/utils/host_memory.py: when the entry points re-execute with glibc.malloc.hugetlb=1, that
they do so once with the command line intact, and that the tunable does what it is there for (large
blocks fault in huge pages instead of 4 KiB pages)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from caper_jax.utils.host_memory import TUNABLE, thp_mode, tunables_with_huge_pages

LINUX = dict(system="Linux", libc=("glibc", "2.36"), mode="madvise")


@pytest.mark.parametrize("environ, changes, expected", [
    ({}, {}, "glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {}, "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}, None),          # the user's choice, the opt-out
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, {}, None),          # the re-executed process
    ({}, {"mode": "always"}, None),                                    # huge pages already
    ({}, {"mode": "never"}, None),
    ({}, {"mode": None}, None),                                        # no THP file
    ({}, {"libc": ("glibc", "2.34")}, None),                           # tunable unknown before 2.35
    ({}, {"libc": ("glibc", "2.35")}, "glibc.malloc.hugetlb=1"),
    ({}, {"libc": ("", "")}, None),                                    # musl and others
    ({}, {"libc": ("glibc", "unknown")}, None),
    ({}, {"system": "Darwin", "libc": ("", "")}, None),
])
def test_tunables_decision(environ, changes, expected):
    assert tunables_with_huge_pages(environ, **{**LINUX, **changes}) == expected


@pytest.mark.parametrize("text, expected", [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
    ("garbage\n", None),
])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, expected):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert thp_mode(str(path)) == expected
    assert thp_mode(str(tmp_path / "missing")) is None


def _python(code: str, *args: str, tunables: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


QUALIFIES = tunables_with_huge_pages({}, system=platform.system(), libc=platform.libc_ver(), mode=thp_mode())


def test_reexec_happens_once_with_the_command_line_intact():
    code = ("import os, sys\n"
            "print('started', flush=True)\n"
            "from caper_jax.utils.host_memory import reexec_with_huge_pages\n"
            "reexec_with_huge_pages()\n"
            "print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:], sys.executable)\n")
    lines = _python(code, "--flag=a b", "last").stdout.splitlines()
    expected_tunables = QUALIFIES   # None where this machine does not qualify: then no re-exec
    assert lines == ["started"] * (2 if expected_tunables else 1) + [
        f"{expected_tunables} ['--flag=a b', 'last'] {sys.executable}"]


@pytest.mark.skipif(QUALIFIES is None, reason="needs Linux, glibc >= 2.35 and transparent huge pages in madvise mode")
def test_the_tunable_makes_large_blocks_fault_in_huge_pages():
    """A 256 MiB block written once: 65,536 faults of 4 KiB without the tunable; with it, the 2 MiB
    pages need 128, and the block's unaligned ends up to 1,022 of 4 KiB (639 in all here). The bound
    leaves room for a kernel that finds no free huge page for part of the block."""
    # Straight through malloc (NumPy would madvise its own large arrays for huge pages).
    code = ("import ctypes, resource\n"
            "libc = ctypes.CDLL(None)\n"
            "libc.malloc.restype = ctypes.c_void_p\n"
            "libc.malloc.argtypes = [ctypes.c_size_t]\n"
            "block = libc.malloc(256 * 2**20)\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "ctypes.memset(block, 1, 256 * 2**20)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    plain = int(_python(code).stdout)
    huge = int(_python(code, tunables=f"{TUNABLE}=1").stdout)
    assert plain >= 60_000, plain
    assert huge < plain / 4, (huge, plain)
