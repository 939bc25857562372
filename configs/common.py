"""Helpers shared by the configs: `:arg` parsing in the style of big_vision."""
from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """Parses ``"model=tiny,steps=100,fast"`` into a ConfigDict over ``defaults``.

    A bare word ``fast`` means ``fast=True``. Values are converted to the type of their default, and a
    key that has no default is refused: a typo in a ``:arg`` variant must not pass silently.
    """
    result = ml_collections.ConfigDict(dict(defaults))
    if not arg:
        return result
    for item in arg.split(","):
        item = item.strip()
        if not item:
            continue
        key, _, value = item.partition("=")
        if key not in defaults:
            raise KeyError(f"unknown config arg {key!r}; known: {sorted(defaults)}")
        default = defaults[key]
        if not _:
            value = True
        elif isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config arg {key}={value!r} is not a bool")
            value = value.lower() in ("true", "1")
        elif default is not None:
            try:
                value = type(default)(value)
            except ValueError:
                raise ValueError(f"config arg {key}={value!r} is not {type(default).__name__}") from None
        result[key] = value
    return result


def apply_pod(config: ml_collections.ConfigDict, pods: dict[str, dict], pod: str, model: str) -> None:
    """Sets the fields of ``pods[pod]`` (dotted keys: ``"data.batch_size"``) on ``config``: one recipe per Cloud TPU
    slice, each checked with ``--compile_for=<that slice>`` (docs/scale.md). Recipes are for Qwen3.5-9B."""
    if not pod:
        return
    if pod not in pods:
        raise KeyError(f"config arg pod={pod!r}; recipes exist for {sorted(pods)}")
    if model != "qwen35_9b":
        raise ValueError(f"config arg pod={pod!r} is a Qwen3.5-9B recipe: add model=qwen35_9b")
    for dotted, value in pods[pod].items():
        *parents, leaf = dotted.split(".")
        section = config
        for name in parents:
            section = section[name]
        section[leaf] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
