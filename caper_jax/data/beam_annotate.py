"""Annotation as an Apache Beam transform, so ``CaperTuples`` can build on any Beam runner.

The generator path of ``tfds_caper`` annotates trajectories one after another in one process. Here
the trajectories become a PCollection and each worker runs its own ``Annotator`` (SQLite
connections cannot be pickled, so it is opened in ``DoFn.setup``). The output is the same
``(key, example)`` stream with the same keys (``"<trajectory>-<tuple>"``): annotation of a
trajectory is a pure function of the trajectory and the settings, so the dataset does not depend
on the runner or on how trajectories are spread over workers. The build summary is a Beam
combine over per-trajectory counts, written as ``summary_<split>.json`` like the generator path.

Runners: the DirectRunner (local, ``--direct_num_workers``/``--direct_running_mode``) and any
distributed runner whose workers see ``manual_dir`` (the SQLite files are opened by path).
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import tensorflow_datasets as tfds

from caper_jax.sql.tuples import AnnotationSettings, AnnotationSummary, Annotator

beam = tfds.core.lazy_imports.apache_beam


class _AnnotateFn(beam.DoFn):
    """(index, trajectory) -> (key, tuple dict) for each preference tuple; counts on a side output."""

    def __init__(self, database_dir: list[str], settings: AnnotationSettings, tables: dict[str, dict]):
        self.database_dir, self.settings, self.tables = database_dir, settings, tables   # folders, in search order
        self.annotator = None

    def setup(self) -> None:
        self.annotator = Annotator(tuple(pathlib.Path(d) for d in self.database_dir), self.settings, self.tables)

    def process(self, element: tuple[int, dict]) -> Iterator[Any]:
        index, record = element
        annotation = self.annotator(record)
        for j, t in enumerate(annotation.tuples):
            yield f"{index}-{j}", t.as_dict()
        counts = AnnotationSummary()
        counts.add(annotation)
        yield beam.pvalue.TaggedOutput("summary", counts)

    def teardown(self) -> None:
        if self.annotator is not None:
            self.annotator.close()


class _MergeSummaries(beam.CombineFn):
    def create_accumulator(self):
        return AnnotationSummary()

    def add_input(self, accumulator, summary):
        return accumulator.merge(summary)

    def merge_accumulators(self, accumulators):
        accumulators = iter(accumulators)
        merged = next(accumulators)
        for other in accumulators:
            merged = merged.merge(other)
        return merged

    def extract_output(self, accumulator) -> dict:
        return accumulator.as_dict()


def _write_summary(summary: dict, path: str) -> None:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(summary, indent=2))


@beam.ptransform_fn
def annotate_trajectories(pipeline, trajectories: list[dict], database_dir: list[str], settings: AnnotationSettings,
                          tables: dict[str, dict], summary_path: str):
    """PTransform (pipeline root -> (key, tuple dict)) for ``GeneratorBasedBuilder._generate_examples``.

    ``Reshuffle`` after ``Create`` spreads the trajectories over workers (without it the
    DirectRunner keeps one bundle, i.e. one worker).
    """
    annotated = (pipeline
                 | "Trajectories" >> beam.Create(list(enumerate(trajectories)))
                 | "Spread" >> beam.Reshuffle()
                 | "Annotate" >> beam.ParDo(_AnnotateFn(database_dir, settings, tables)).with_outputs(
                     "summary", main="tuples"))
    _ = (annotated.summary
         | "Summarise" >> beam.CombineGlobally(_MergeSummaries())
         | "WriteSummary" >> beam.Map(_write_summary, summary_path))
    return annotated.tuples
