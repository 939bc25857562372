"""Streaming annotation with Grain: a MapDataset of trajectories -> an IterDataset of tuples.

One trajectory yields 0..n tuples, so annotation is a flat map. Grain offers it in two places:
``FlatMapMapDataset`` needs a fixed ``max_fan_out`` and pads the index space with ``None`` slots,
which wastes random access on a fan-out that varies from 0 to ~10; ``FlatMapIterDataset`` buffers
the tuples of one trajectory and checkpoints as (parent state, position in the buffer). We use the
iterator form: shuffle and shard at the trajectory level (random access is cheap there), then flat
map. On restore the buffered trajectory is annotated again, which gives the same tuples because
an ``Annotator`` seeds each trajectory's randomness from its content.

For training on a fixed set of tuples, build the ArrayRecord dataset instead
(``python -m caper_jax.annotate build``) and read it with ``tuple_source``; streaming is for
annotating on the fly (e.g. fresh policy samples) without a build step.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import grain

from caper_jax.data.tfds_caper import decode, read_tables, read_trajectories
from caper_jax.sql.tuples import AnnotationSettings, Annotator, PreferenceTuple


class AnnotateTrajectory(grain.experimental.FlatMapTransform):
    """Trajectory dict -> its tuples as dicts (``dataclasses.asdict`` of PreferenceTuple).

    Picklable for Grain worker processes: the Annotator reopens its databases after unpickling.
    """

    max_fan_out = 1  # unused by FlatMapIterDataset; required by the base class

    def __init__(self, database_dir: str | os.PathLike, settings: AnnotationSettings = AnnotationSettings(),
                 tables: dict[str, dict] | None = None, *, mutate_correct: bool = False):
        self.annotator = Annotator(database_dir, settings, tables, mutate_correct=mutate_correct)

    def flat_map(self, element: dict) -> Sequence[dict]:
        return [t.as_dict() for t in self.annotator(element).tuples]


def trajectory_dataset(manual_dir: str | os.PathLike, split: str, *, predictions: bool = True,
                       limit: int = 0) -> grain.MapDataset:
    """Trajectories of a Spider/BIRD layout split, as a random-access MapDataset."""
    return grain.MapDataset.source(read_trajectories(manual_dir, split, predictions=predictions, limit=limit))


def annotated_dataset(trajectories: grain.MapDataset, database_dir: str | os.PathLike,
                      settings: AnnotationSettings = AnnotationSettings(), *,
                      tables: dict[str, dict] | None = None, mutate_correct: bool = False,
                      seed: int | None = None, shard_index: int = 0,
                      shard_count: int = 1) -> grain.IterDataset:
    """Tuples streamed from trajectories: [shuffle] -> shard -> flat-map annotate.

    ``tables`` (``read_tables(manual_dir)``) gives the schema text of tables.json; without it the
    schema text is serialised from the SQLite catalogue. ``mutate_correct``: see ``Annotator`` (set
    it True for a stream of predictions without the question records of their golds). ``shard_index``/``shard_count`` give
    each host its own slice of trajectories
    (``jax.process_index()``/``jax.process_count()`` in a multi-host job).
    """
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    if seed is not None:
        trajectories = trajectories.shuffle(seed=seed)
    trajectories = trajectories[shard_index::shard_count]
    return grain.experimental.FlatMapIterDataset(trajectories.to_iter_dataset(),
                                                 AnnotateTrajectory(database_dir, settings, tables,
                                                                    mutate_correct=mutate_correct))


def tuple_source(data_source) -> grain.MapDataset:
    """Tuples of a built dataset (``CaperTuples.as_data_source()[split]``) as PreferenceTuples."""
    return grain.MapDataset.source(data_source).map(decode)


__all__ = ["AnnotateTrajectory", "PreferenceTuple", "annotated_dataset", "read_tables", "trajectory_dataset",
           "tuple_source"]
