"""absl command lines: the flag and config errors of every command (``caper_jax.train``, ``evaluate``,
``verify``, ``convert``, ``annotate``), and the subcommands of those that have them.

A flag error (unknown flag, a typo, a value of the wrong type or outside an enum) is one line on
stderr and exit status 2, the status these commands have always given a bad command line; so is an
error of a ``--config`` file or of its ``--config.<key>`` overrides, an unknown key with the closest
known ones. Every flag of the program is defined on one ``FlagValues``; ``check_command`` refuses
those that the chosen command does not read, so a flag given to the wrong command is an error, as a
typo is.
The errors found after parsing (a flag of another command, a required flag unset, an unknown command)
go through ``usage_error``, not ``absl.app.UsageError``, which ``absl.app.run`` prints after the whole
module docstring and flag list.
"""
from __future__ import annotations

import difflib
import importlib.util
import sys
from collections.abc import Collection, Sequence
from typing import NoReturn

from absl import flags

USAGE_STATUS = 2


# Errors of a config file or of its --config.<key> overrides, raised while the flags are parsed
# (a key typo is an AttributeError, an unknown ``:arg`` a KeyError, a bad value a ValueError).
CONFIG_ERRORS = (flags.Error, AttributeError, KeyError, ValueError, TypeError)


def parse_flags(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS, *,
                config: str | None = None) -> list[str]:
    """``flag_values(argv)``; a flag error becomes one line on stderr and exit status 2.

    ``config``: what the command calls its ``--config`` (a ``config_flags`` file, e.g. "eval config"),
    when one is given: then an error of the config file or of an override is ``error: invalid <config>:
    ...``, an unknown key with the closest known ones (``config_override_error``)."""
    with_config = config is not None and any(a == "--config" or a.startswith("--config=") for a in argv)
    try:
        return flag_values(list(argv))
    except CONFIG_ERRORS as error:
        if with_config and not isinstance(error, flags.UnrecognizedFlagError):   # --workdri is no config's fault
            usage_error(f"invalid {config}: {config_override_error(argv, error)}")
        if not isinstance(error, flags.Error):
            raise
        usage_error(str(error))


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


def _config_keys(config, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if hasattr(value, "items"):
            keys.extend(_config_keys(value, prefix + key + "."))
    return keys


def _load_config_file(argv: Sequence[str]):
    """The ConfigDict named by ``--config=path[:arg]`` in argv, loaded as config_flags does."""
    spec = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_caper_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def config_override_error(argv: Sequence[str], error: Exception) -> str:
    """What went wrong while absl parsed a ``config_flags`` config and its overrides, as one message.

    An unknown ``--config.<key>`` names the closest known keys (the config file is loaded once more to
    list them); any other error is its own text (a KeyError's without the quotes ``str`` adds)."""
    overrides = [a.split("=")[0].removeprefix("--config.") for a in argv[1:] if a.startswith("--config.")]
    try:  # the config file itself loaded, or the override would not have been reached: its keys
        known = _config_keys(_load_config_file(argv))
    except Exception:  # noqa: BLE001 - suggestions are best effort only
        known = []
    lines = []
    for key in overrides:
        if known and key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            lines.append(f"unknown config key {key!r}" + (f"; did you mean {close}?" if close else ""))
    if lines:
        return "\nerror: ".join(lines)
    text = str(error.args[0] if isinstance(error, KeyError) and len(error.args) == 1 else error)
    head, traceback_marker, trace = text.partition("Traceback (most recent call last):")
    if traceback_marker:   # config_flags puts the config file's whole traceback in the message: its last line
        last = [line.strip() for line in trace.splitlines() if line.strip()][-1:]
        text = " ".join([head.strip().rstrip(":") + ":", *last])
    return text


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
