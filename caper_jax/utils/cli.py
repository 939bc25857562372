"""absl command lines with subcommands (``caper_jax.evaluate``, ``caper_jax.verify``, ``caper_jax.convert``).

A flag error (unknown flag, a typo, a value of the wrong type or outside an enum) is one line on
stderr and exit status 2, the status these commands have always given a bad command line. Every
flag of the program is defined on one ``FlagValues``; ``check_command`` refuses those that the
chosen command does not read, so a flag given to the wrong command is an error, as a typo is.
The errors found after parsing (a flag of another command, a required flag unset, an unknown command)
go through ``usage_error``, not ``absl.app.UsageError``, which ``absl.app.run`` prints after the whole
module docstring and flag list.
"""
from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from typing import NoReturn

from absl import flags

USAGE_STATUS = 2


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS, *,
                errors: tuple[type[Exception], ...] = (flags.Error,), prefix: str = "error") -> list[str]:
    """``flag_values(argv)``; any of ``errors`` becomes ``prefix: error`` on stderr and exit status 2."""
    try:
        return flag_values(list(argv))
    except errors as error:
        usage_error(str(error), prefix=prefix)


def usage_error(message: str, *, prefix: str = "error") -> NoReturn:
    """``prefix: message``, one line on stderr, and exit status 2."""
    print(f"{prefix}: {message}", file=sys.stderr)
    sys.exit(USAGE_STATUS)


def config_load_error(config) -> str | None:
    """Why the file of a ``config_flags`` config failed to load, or None (also for no config).

    config_flags does not raise for a config file that is missing or fails to import: it hands back
    a stand-in that raises an OSError, with every path it tried, at the first attribute read.
    Reading one here turns that into one line."""
    if config is None:
        return None
    try:
        config.keys   # noqa: B018 - any attribute: the stand-in raises its loading error
    except OSError as error:
        reason = str(error).strip().splitlines()[-1].strip()
        return f"--config: cannot load the config file: {reason}"
    return None


def check_command(flag_values: flags.FlagValues, usage: str, *, defined: Collection[str],
                  reads: Collection[str], required: Collection[str] = ()) -> None:
    """A ``usage_error`` for a required flag unset, or a flag of ``defined`` given that the command
    does not read."""
    foreign = [f"--{name}" for name in defined if name not in reads and flag_values[name].present]
    if foreign:
        usage_error(f"{usage}: not a flag of this command: {', '.join(foreign)}")
    missing = [f"--{name}" for name in required if flag_values[name].value is None]
    if missing:
        usage_error(f"{usage}: {', '.join(missing)} required")
