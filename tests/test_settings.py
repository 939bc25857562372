"""caper_jax.settings: a config turned once into frozen dataclasses, checked field by field, and back.

Every settings class is built here from its own config in ``configs/``; what a run saves (``as_dict``) is
compared with what ``ConfigDict.to_dict`` gave before the settings existed, key by key and value by value.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import typing
from collections.abc import Mapping
from typing import Literal

import pytest

from caper_jax.annotate import AnnotateSettings
from caper_jax.eval.settings import EvalSettings
from caper_jax.experiments.settings import ReproduceSettings, SpiderVerifierSettings
from caper_jax.prm.settings import PrmSettings
from caper_jax.rl.settings import GrpoSettings
from caper_jax.sections import OptimSettings
from caper_jax.settings import SettingsError, as_dict, from_config, replace
from caper_jax.sft.settings import SftSettings
from configs import annotate, grpo, prm, reproduce, sft, spider_verifier
from configs import eval as eval_config
from tests.helpers import REPO


def _full_reproduction():
    config = reproduce.get_config("full")
    config.data.dir = "/data/spider"          # :full takes its data folder from the command line
    return config


def _clause_grpo():
    config = grpo.get_config("variant=clause")
    config.prm.workdir = "/runs/prm"          # the clause variant reads a PRM run
    return config


CONFIGS = [
    (PrmSettings, lambda: prm.get_config()), (PrmSettings, lambda: prm.get_config("model=qwen35_9b,data=spider")),
    (SftSettings, lambda: sft.get_config()), (SftSettings, lambda: sft.get_config("model=qwen35_9b")),
    (GrpoSettings, lambda: grpo.get_config()), (GrpoSettings, _clause_grpo),
    (EvalSettings, lambda: eval_config.get_config()), (EvalSettings, lambda: eval_config.get_config("big,k=4")),
    (ReproduceSettings, lambda: reproduce.get_config()), (ReproduceSettings, lambda: reproduce.get_config("fast")),
    (ReproduceSettings, _full_reproduction),
    (SpiderVerifierSettings, lambda: spider_verifier.get_config("fast")),
    (AnnotateSettings, lambda: annotate.get_config()), (AnnotateSettings, lambda: annotate.get_config("bird")),
]


@pytest.mark.parametrize("cls, make", CONFIGS)
def test_every_config_builds_and_saves_what_it_saved_before(cls, make):
    """as_dict is what a run saves (checkpoints' config item, the evaluation's results.json): the same JSON,
    key order included, as the ConfigDict gave, so saved runs and resumption read it as before."""
    config = make()
    settings = from_config(cls, config)
    assert json.dumps(as_dict(settings)) == json.dumps(config.to_dict())
    assert from_config(cls, as_dict(settings)) == settings      # and it builds back to the same settings


def test_an_unknown_key_is_refused_with_its_path_and_the_near_miss():
    config = prm.get_config()
    config.data.unlock()
    config.data.max_lenn = 10
    with pytest.raises(SettingsError, match=r"^unknown setting data.max_lenn; did you mean data.max_len\?$"):
        from_config(PrmSettings, config)
    nested = reproduce.get_config()
    nested.prm.optim.unlock()
    nested.prm.optim.lrr = 1.0
    with pytest.raises(SettingsError, match=r"^unknown setting prm.optim.lrr; did you mean prm.optim.lr\?$"):
        from_config(ReproduceSettings, nested)


def test_a_missing_key_is_refused_with_its_path():
    config = sft.get_config().to_dict()
    del config["eval"]["timeout_s"], config["chunk_size"]
    with pytest.raises(SettingsError, match=r"^missing setting chunk_size$"):
        from_config(SftSettings, config)
    config["chunk_size"] = 128
    with pytest.raises(SettingsError, match=r"^missing setting eval.timeout_s$"):
        from_config(SftSettings, config)


frozen = dataclasses.dataclass(frozen=True, kw_only=True)


@frozen
class _Inner:
    rate: float
    flag: bool
    count: int


@frozen
class _Outer:
    inner: _Inner
    sizes: tuple[int, ...]
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...]
    mode: Literal["fast", "slow"]
    shape: Mapping[str, int]


def _outer(**changes):
    values = {"inner": {"rate": 1, "flag": True, "count": 3}, "sizes": [1, 2], "mode": "fast",
              "rules": [["batch", ["data", "fsdp"]], ["length", None], ["embed", "fsdp"]], "shape": {"data": 1}}
    return {**values, **changes}


def test_values_are_converted_to_their_annotation():
    built = from_config(_Outer, _outer())
    assert built.inner == _Inner(rate=1.0, flag=True, count=3) and isinstance(built.inner.rate, float)
    assert built.sizes == (1, 2) and built.rules == (("batch", ("data", "fsdp")), ("length", None), ("embed", "fsdp"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.sizes = (3,)


@pytest.mark.parametrize("changes, message", [
    ({"inner": {"rate": 1.0, "flag": 1, "count": 3}}, r"^inner.flag=1: expected a bool, got int$"),
    ({"inner": {"rate": 1.0, "flag": True, "count": True}}, r"^inner.count=True: expected an int, got bool$"),
    ({"inner": {"rate": "1", "flag": True, "count": 3}}, r"^inner.rate='1': expected a number, got str$"),
    ({"sizes": [1, "2"]}, r"^sizes\[1\]='2': expected an int, got str$"),
    ({"sizes": 3}, r"^sizes=3: expected a sequence, got int$"),
    ({"mode": "fsat"}, r"^mode='fsat'; did you mean fast\?$"),
    ({"rules": [["batch", 3]]}, r"^rules\[0\]\[1\]=3: expected str or tuple or NoneType$"),
    ({"shape": {"data": "1"}}, r"^shape.data='1': expected an int, got str$"),
])
def test_a_value_of_the_wrong_type_is_refused_with_its_path(changes, message):
    with pytest.raises(SettingsError, match=message):
        from_config(_Outer, _outer(**changes))


def test_a_free_mapping_is_read_only_and_saved_as_a_dict():
    settings = from_config(PrmSettings, prm.get_config())
    with pytest.raises(TypeError):
        settings.mesh_shape["fsdp"] = 2
    assert as_dict(settings)["mesh_shape"] == {"data": 1, "fsdp": -1, "tensor": 1}


def test_settings_errors_reach_the_command_line_as_one_line():
    """SettingsError is a ValueError: train.py's `invalid config: ...` path prints it."""
    assert issubclass(SettingsError, ValueError)


def test_replace_changes_fields_by_path_and_checks_the_result():
    settings = from_config(PrmSettings, prm.get_config())
    changed = replace(settings, {"seed": 3, "data.dir": "/x", "model.init_from": "/runs/sft"})
    assert (changed.seed, changed.data.dir, changed.model.init_from) == (3, "/x", "/runs/sft")
    assert changed.optim is settings.optim and settings.data.dir == ""       # the rest shared, the original kept
    with pytest.raises(ValueError, match=r"must be increasing and <= data.max_len"):
        replace(settings, {"data.max_len": 100})
    with pytest.raises(SettingsError, match=r"unknown setting dta; did you mean data\?"):
        replace(settings, {"dta.dir": "/x"})


def test_a_stage_rule_is_named_by_its_stage():
    config = reproduce.get_config()
    config.grpo.rl.group_size = 1
    with pytest.raises(ValueError, match=r"^grpo.rl.group_size=1 must be >= 2"):
        from_config(ReproduceSettings, config)
    config = reproduce.get_config()
    config.prm.data.batch_size = 0
    with pytest.raises(ValueError, match=r"^prm.data.batch_size=0 and data.eval_batch_size=32 must be >= 1"):
        from_config(ReproduceSettings, config)
    config = reproduce.get_config()
    config.grpo.policy.sft_workdir, config.grpo.model.hf_dir = "/runs/sft", "/ckpt"
    with pytest.raises(ValueError, match=r"^grpo: set at most one of policy.sft_workdir and model.hf_dir"):
        from_config(ReproduceSettings, config)


def test_annotate_alpha_is_the_annotators_penalty_and_the_losss_weight_scale():
    """One setting, two uses (configs/prm.py annotate.alpha): the annotator's penalty at v* and the pair
    loss's delta / alpha, named annotation_alpha there."""
    config = prm.get_config()
    config.annotate.alpha = 2.0
    settings = from_config(PrmSettings, config)
    assert settings.annotation.alpha == settings.pair_loss.annotation_alpha == 2.0


def _settings_classes():
    """Every dataclass reachable from the top-level settings classes (their sections, and the stages')."""
    seen, todo = [], [PrmSettings, SftSettings, GrpoSettings, EvalSettings, ReproduceSettings,
                      SpiderVerifierSettings, AnnotateSettings]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        todo += [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return seen


def test_the_settings_classes_hold_no_defaults_and_are_frozen():
    """configs/ hold every default, once: a field with a default here would be a second one."""
    classes = _settings_classes()
    assert OptimSettings in classes and len(classes) > 25
    for cls in classes:
        assert cls.__dataclass_params__.frozen, cls
        defaults = [f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert not defaults, (cls.__name__, defaults)


# -- code reads fields: no config.get(key, default), getattr(config, key, default) or "key" in config

SETTINGS_NAMES = {"config", "settings"}
# Not settings: modules that read a SAVED run's config.json (a file, in whatever layout it was saved).
NOT_SETTINGS = {"caper_jax/upgrade_run.py", "caper_jax/runs.py"}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def probes(source: str) -> list[str]:
    """``line: code`` of each read of a setting with a default in code, or of a probe for a key."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and _root(node.func.value) in SETTINGS_NAMES:
            found.append(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                and len(node.args) == 3 and _root(node.args[0]) in SETTINGS_NAMES:
            found.append(node)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_root(c) in SETTINGS_NAMES for c in node.comparators):
            found.append(node)
    return [f"{n.lineno}: {ast.unparse(n)}" for n in found]


def test_the_probe_finds_each_kind_of_default_in_code():
    source = ('a = config.get("k", 0)\nb = settings.data.get("schema_values", 0)\nc = getattr(config, "x", 1)\n'
              'd = "bucket_lengths" in config.data\ne = "model" not in settings\n'
              'f = run.config.get("trainer")\ng = settings.data.max_len\n')
    assert [p.split(":")[0] for p in probes(source)] == ["1", "2", "3", "4", "5"]


def test_code_reads_settings_fields_never_a_default_in_code():
    package = REPO / "caper_jax"
    found = {str(path.relative_to(REPO)): probes(path.read_text()) for path in sorted(package.rglob("*.py"))
             if str(path.relative_to(REPO)) not in NOT_SETTINGS}
    assert {path: lines for path, lines in found.items() if lines} == {}
    assert all((REPO / path).is_file() for path in NOT_SETTINGS)
