"""Typed settings: a config (``ml_collections.ConfigDict`` or a mapping) turned once into frozen dataclasses.

A trainer's boundary is ``from_config(PrmSettings, config)``: every key of the config must be a field of its
section (else ``unknown setting data.max_lenn; did you mean data.max_len?``), every field must be set (the
configs in ``configs/`` hold every default, once), and each value is converted to its field's annotation:

    int, str, bool      exactly that type (an int is not a bool, a bool not an int)
    float               a float or an int
    tuple[X, ...]       a list or tuple of X (nested: the sharding rules' pairs)
    Literal[a, b]       one of the choices (did-you-mean on a near miss)
    Mapping[str, X]     a free mapping of names to X (``mesh_shape``), held read-only
    a dataclass         a nested section: a mapping, converted field by field

Every problem is one ``SettingsError`` (a ``ValueError``) naming the dotted path, so the command lines'
``invalid config: ...`` line prints it. A section's own value rules are its ``__post_init__``; rules across
sections are the enclosing class's. ``as_dict`` turns settings back into the JSON a run saves (keys sorted,
as ``ConfigDict.to_dict`` gives them), ``replace`` changes fields by dotted path (the experiments' wiring).

No JAX here: the SQL side and the command lines' flag checks import it.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


class SettingsError(ValueError):
    """A config that does not fit its settings class: an unknown or missing key, a value of the wrong type."""


class Settings:
    """A trainer's (or experiment's) whole settings, as opposed to one section of them: where one is nested
    in another (an experiment's stages), its errors are named by the stage (``sft: model.remat=...``)."""


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; expected one of {sorted(map(str, choices))}"


def one_of(value, choices, name: str, error: type[Exception] = SettingsError) -> None:
    """A value that must be one of ``choices``: one line naming the setting, the value and the choices."""
    if value not in choices:
        expected = f"{choices[0]!r} or {choices[1]!r}" if len(choices) == 2 else f"one of {tuple(choices)}"
        raise error(f"{name}={value!r}; expected {expected}")


def _type_name(kind) -> str:
    return getattr(kind, "__name__", str(kind))


def _convert(value: Any, kind, path: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, Mapping) and not hasattr(value, "to_dict"):
            raise SettingsError(f"{path} is a section of settings, got {type(value).__name__} {value!r}")
        return from_config(kind, value, path=path)
    if origin is Literal:
        if value not in args:
            raise SettingsError(f"{path}={value!r}" + did_you_mean(str(value), args))
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{path}={value!r}: expected a bool, got {type(value).__name__}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"{path}={value!r}: expected an int, got {type(value).__name__}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{path}={value!r}: expected a number, got {type(value).__name__}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise SettingsError(f"{path}={value!r}: expected a str, got {type(value).__name__}")
        return value
    if kind is type(None):
        if value is not None:
            raise SettingsError(f"{path}={value!r}: expected None")
        return value
    if origin in (typing.Union, types.UnionType):   # X | None: the first member the value fits
        for member in args:
            try:
                return _convert(value, member, path)
            except SettingsError:
                continue
        raise SettingsError(f"{path}={value!r}: expected {' or '.join(_type_name(a) for a in args)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SettingsError(f"{path}={value!r}: expected a sequence, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise SettingsError(f"{path}={value!r}: expected {len(args)} items")
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (Mapping, dict, typing.Mapping):
        if hasattr(value, "to_dict"):
            value = value.to_dict()
        if not isinstance(value, Mapping):
            raise SettingsError(f"{path}={value!r}: expected a mapping, got {type(value).__name__}")
        key_kind, value_kind = args
        return types.MappingProxyType({_convert(k, key_kind, f"{path} key"): _convert(v, value_kind, f"{path}.{k}")
                                       for k, v in value.items()})
    raise TypeError(f"{path}: no conversion for the annotation {kind!r}")


def from_config(cls: type, config: Any, *, path: str = "") -> Any:
    """``cls`` (a dataclass of sections) built from ``config``, every key a field, every field set."""
    # ConfigDict: plain dicts and tuples, field references resolved. The one place a config's keys are probed.
    given = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(given, Mapping):
        raise SettingsError(f"{path or 'config'}: expected a mapping, got {type(given).__name__}")
    prefix = f"{path}." if path else ""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in given:
        if key not in fields:
            raise SettingsError(f"unknown setting {prefix}{key}" + did_you_mean(str(key), fields, prefix))
    missing = [f"{prefix}{name}" for name in fields if name not in given]
    if missing:
        raise SettingsError(f"missing setting{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    try:
        return cls(**{name: _convert(given[name], hints[name], f"{prefix}{name}") for name in fields})
    except SettingsError:   # names its dotted path already
        raise
    except (ValueError, KeyError) as error:
        if path and issubclass(cls, Settings):   # a stage's rule (an experiment's sft, prm, ...): named by the stage
            raise type(error)(_in_stage(path, str(error.args[0]) if error.args else str(error), fields)) from error
        raise


def _in_stage(stage: str, message: str, fields: list[str]) -> str:
    """``grpo.rl.group_size=0 must ...`` for a message that starts with a field's path; else ``grpo: ...``."""
    first = re.match(r"[A-Za-z_]\w*", message)
    return f"{stage}.{message}" if first and first.group() in fields else f"{stage}: {message}"


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_dict(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def as_dict(settings: Any) -> dict:
    """The settings as the nested dict ``ConfigDict.to_dict`` gives (keys sorted; tuples kept): what a run saves."""
    return {f.name: _plain(getattr(settings, f.name))
            for f in sorted(dataclasses.fields(settings), key=lambda f: f.name) if f.init}


def replace(settings: Any, changes: Mapping[str, Any]) -> Any:
    """``settings`` with the fields named by dotted path in ``changes`` replaced (``{"data.dir": "/x"}``);
    each changed section, and every section above it, is built again, so their rules run on the result."""
    nested: dict[str, dict[str, Any]] = {}
    direct: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(settings)}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if head not in names:
            raise SettingsError(f"unknown setting {head}" + did_you_mean(head, names))
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, sub in nested.items():
        direct[head] = replace(getattr(settings, head), sub)
    return dataclasses.replace(settings, **direct)
