"""``annotate build --beam``: the TFDS build on Apache Beam (DirectRunner) gives the same dataset.

The reference is the plain generator build of the same builder config on the same Spider subset
(itself checked against SQLite by the annotation tests): same records, same summary counts. Beam
runs with two workers so trajectories really are split across annotator instances.
"""
from __future__ import annotations

import json
import os
import pathlib

import pytest

from caper_jax import annotate
from caper_jax.settings import from_config
from configs.annotate import get_config

LIMIT = 12  # questions of Spider dev; ~0.1 s of annotation each on 2 cores


def _apache_beam():
    try:
        import apache_beam
    except ImportError:
        message = "apache-beam is not installed (pip install apache-beam; docs/scale.md)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return apache_beam


def _build(spider: pathlib.Path, data_dir: pathlib.Path, beam_options: str | None) -> tuple[list, dict]:
    import tensorflow_datasets as tfds

    config = get_config(f"spider,limit={LIMIT}")
    config.data.manual_dir = str(spider)
    config.data_dir = str(data_dir)
    summary = annotate.run_build(from_config(annotate.AnnotateSettings, config), beam_options=beam_options)
    (dataset_dir,) = [p.parent for p in data_dir.rglob("dataset_info.json")]
    builder = tfds.builder_from_directory(str(dataset_dir))
    source = builder.as_data_source(split="dev")
    records = sorted(json.dumps({k: (v.decode() if isinstance(v, bytes) else float(v)) for k, v in source[i].items()},
                                sort_keys=True) for i in range(len(source)))
    return records, summary["dev"]


def test_beam_build_matches_generator_build(spider, tmp_path):
    _apache_beam()
    local_records, local_summary = _build(spider, tmp_path / "local", None)
    beam_records, beam_summary = _build(
        spider, tmp_path / "beam", "--runner=DirectRunner --direct_num_workers=2 --direct_running_mode=multi_threading")
    assert local_summary["trajectories"] == LIMIT
    assert len(local_records) == local_summary["tuples"] > 0
    assert beam_records == local_records
    assert beam_summary == local_summary
