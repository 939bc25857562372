"""Which text-to-SQL world a run trains on: the built-in demo world or Spider/BIRD-layout data.

Every trainer (PRM, SFT, GRPO) and the evaluator start from ``prepare_world(config, workdir)``:

* ``config.data.kind == "demo"``: the demo world is built under ``<workdir>/demo_world`` (or reused
  when its manifest matches) together with the demo tokenizer — no downloads.
* ``config.data.kind == "spider"``: ``config.data.dir`` holds Spider/BIRD layout
  (``train_spider.json``/``dev.json``, ``tables.json``, ``database/<db>/<db>.sqlite``); the tokenizer
  comes from ``config.model.tokenizer_dir`` or the model's HF directory.
"""
from __future__ import annotations

import dataclasses
import pathlib


class WorldError(ValueError):
    """The configured data cannot be used."""


@dataclasses.dataclass
class DataWorld:
    dir: pathlib.Path              # Spider layout root
    database_dir: pathlib.Path     # <db_id>/<db_id>.sqlite below it
    tokenizer: object              # transformers PreTrainedTokenizer(Fast)
    kind: str

    def db_path(self, db_id: str) -> pathlib.Path:
        return self.database_dir / db_id / f"{db_id}.sqlite"


def _tokenizer_from(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def prepare_world(config, workdir: str | pathlib.Path) -> DataWorld:
    kind = config.data.kind
    if kind == "demo":
        from caper_jax.data.demo_world import build_demo_world
        from caper_jax.data.tokenizer import build_demo_tokenizer

        root = pathlib.Path(config.data.dir) if config.data.dir else pathlib.Path(workdir) / "demo_world"
        build_demo_world(root, seed=config.seed, train_size=config.data.demo_train_size,
                         dev_size=config.data.demo_dev_size)
        tok_dir = root / "tokenizer"
        if config.model.tokenizer_dir:
            tokenizer = _tokenizer_from(config.model.tokenizer_dir)
        elif (tok_dir / "tokenizer.json").exists():
            tokenizer = _tokenizer_from(str(tok_dir))
        else:
            tokenizer = build_demo_tokenizer(tok_dir, seed=config.seed)
        return DataWorld(root, root / "database", tokenizer, kind)
    if kind == "spider":
        if not config.data.dir:
            raise WorldError("data.kind='spider' needs --config.data.dir=<Spider/BIRD layout directory>")
        root = pathlib.Path(config.data.dir)
        if not root.is_dir():
            raise WorldError(f"data.dir {root} does not exist")
        source = config.model.tokenizer_dir or config.model.hf_dir
        if not source:
            raise WorldError("Spider data needs a tokenizer: set model.tokenizer_dir or model.hf_dir")
        databases = [root / d for d in ("database", "dev_databases", "train_databases") if (root / d).is_dir()]
        if not databases:
            raise WorldError(f"{root} has no database/ (or BIRD dev_databases/) directory")
        return DataWorld(root, databases[0], _tokenizer_from(source), kind)
    raise WorldError(f"data.kind={kind!r}; expected 'demo' or 'spider'")
