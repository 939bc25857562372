"""glibc's malloc asked to back its large blocks with transparent huge pages, for XLA:CPU's sake.

XLA:CPU allocates an executable's temporaries afresh at every call, as one block (1.12 GB for the
miniature's 32 x 256 train step), and glibc serves any block over 32 MiB with a fresh ``mmap``, so
the kernel maps and zeroes it 4 KiB at a fault, at every step: 275k page faults and 0.5 s of kernel
time in a 0.9 s step of the miniature on 2 cores (BENCHMARKS.md, "Host memory"). With the tunable
``glibc.malloc.hugetlb=1`` (glibc >= 2.35) malloc marks its mmaps ``MADV_HUGEPAGE``, and where the
kernel's transparent huge pages are in ``madvise`` mode such a block faults in 2 MiB at a time:
about 700 faults and 0.1 s of kernel time per step, the step 0.65-0.70 s.

glibc reads tunables once, when a process starts; so the command-line entry points call
``reexec_with_huge_pages()`` first, which re-executes the same command line once with the tunable
added to ``GLIBC_TUNABLES``. It does nothing off Linux/glibc, on a glibc too old to know the tunable,
where transparent huge pages are off or already ``always``, or where ``GLIBC_TUNABLES`` already
names ``glibc.malloc.hugetlb`` (which is also how to opt out: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=0``).
This module imports no JAX: it must run before anything allocates much.
"""
from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)   # the first release with glibc.malloc.hugetlb


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``, the bracketed
    word of ``path``), or None where the file is missing or unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def tunables_with_huge_pages(environ: Mapping[str, str], *, system: str, libc: tuple[str, str],
                             mode: str | None) -> str | None:
    """The ``GLIBC_TUNABLES`` value to re-execute with, or None where nothing is to be done.

    ``system``: ``platform.system()``; ``libc``: ``platform.libc_ver()``; ``mode``: ``thp_mode()``.
    """
    current = environ.get("GLIBC_TUNABLES", "")
    if system != "Linux" or libc[0] != "glibc" or mode != "madvise" or TUNABLE in current:
        return None
    try:
        version = tuple(int(part) for part in libc[1].split(".")[:2])
    except ValueError:
        return None
    if version < MIN_GLIBC:
        return None
    return ":".join(filter(None, (current, f"{TUNABLE}=1")))


def reexec_with_huge_pages() -> None:
    """Re-executes this process's command line (``sys.orig_argv``) with ``glibc.malloc.hugetlb=1``
    added to ``GLIBC_TUNABLES``, where that is to be done (see the module docstring); else returns.
    The new process finds the tunable set and returns from here, so this happens at most once."""
    tunables = tunables_with_huge_pages(os.environ, system=platform.system(), libc=platform.libc_ver(),
                                        mode=thp_mode())
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # argv[0] is the interpreter's own path, so that a virtual environment's python stays itself.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "GLIBC_TUNABLES": tunables})
