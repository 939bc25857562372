"""Which text-to-SQL world a run trains on: the built-in demo world or Spider/BIRD-layout data.

Every trainer (PRM, SFT, GRPO) starts from ``prepare_world(settings, workdir)``:

* ``data.kind == "demo"``: the demo world is built under ``<workdir>/demo_world`` (or reused
  when its manifest matches) together with the demo tokenizer — no downloads.
* ``data.kind == "spider"``: ``data.dir`` holds Spider or BIRD layout, read by
  ``caper_jax.data.spider`` (Spider: ``train_spider.json`` + ``train_others.json``, ``dev.json``,
  ``tables.json``, ``database/``; BIRD: ``train/train.json``, ``dev.json``, ``<split>_tables.json``,
  ``dev_databases/`` and ``train_databases/``); the tokenizer comes from ``model.tokenizer_dir``
  or the model's HF directory.

``DataWorld.database_dir`` is every database folder of the layout (a tuple, searched in order):
``Executors`` and ``Annotator`` take it as it is, so a BIRD root finds its training databases as
well as its dev ones.
"""
from __future__ import annotations

import dataclasses
import pathlib

from caper_jax.data import spider as readers
from caper_jax.demo.world import build_demo_world


class WorldError(ValueError):
    """The configured data cannot be used."""


@dataclasses.dataclass
class DataWorld:
    dir: pathlib.Path                          # Spider/BIRD layout root
    database_dir: tuple[pathlib.Path, ...]     # folders with <db_id>/<db_id>.sqlite (readers.database_dirs)
    tokenizer: object                          # transformers PreTrainedTokenizer(Fast)
    kind: str
    tokenizer_dir: pathlib.Path                # where the tokenizer was loaded from (saved with checkpoints)

    def db_path(self, db_id: str, split: str | None = None) -> pathlib.Path:
        """``<db_id>.sqlite`` (``split``'s own folder first); raises ``readers.MissingDatabaseError``."""
        return readers.db_path(self.dir, db_id, split)


def _tokenizer_from(path: str):
    from transformers import AutoTokenizer  # transformers loads only when a tokenizer is read

    return AutoTokenizer.from_pretrained(path)


def prepare_world(settings, workdir: str | pathlib.Path) -> DataWorld:
    """The world of a trainer's settings (``data``, ``model``, ``seed``; checked when they were built,
    ``caper_jax.sections``): whether ``data.dir`` holds a usable layout is found here."""
    kind = settings.data.kind
    if kind == "demo":
        from caper_jax.data.tokenizer import build_demo_tokenizer  # transformers, tokenizers: the demo only

        root = pathlib.Path(settings.data.dir) if settings.data.dir else pathlib.Path(workdir) / "demo_world"
        build_demo_world(root, seed=settings.seed, train_size=settings.data.demo_train_size,
                         dev_size=settings.data.demo_dev_size)
        tok_dir = root / "tokenizer"
        if settings.model.tokenizer_dir:
            tok_dir = pathlib.Path(settings.model.tokenizer_dir)
            tokenizer = _tokenizer_from(settings.model.tokenizer_dir)
        elif (tok_dir / "tokenizer.json").exists():
            tokenizer = _tokenizer_from(str(tok_dir))
        else:
            tokenizer = build_demo_tokenizer(tok_dir, seed=settings.seed)
        return DataWorld(root, readers.database_dirs(root), tokenizer, kind, tok_dir)
    # spider: data.dir and a tokenizer are set (caper_jax.sections.check_world)
    root = pathlib.Path(settings.data.dir)
    if not root.is_dir():
        raise WorldError(f"data.dir {root} does not exist")
    source = settings.model.tokenizer_dir or settings.model.hf_dir
    databases = readers.database_dirs(root)
    if not databases:
        raise WorldError(f"{root} has no database folder (Spider: database/; BIRD: dev_databases/, "
                         f"train_databases/ or dev/dev_databases/, train/train_databases/)")
    return DataWorld(root, databases, _tokenizer_from(source), kind, pathlib.Path(source))
