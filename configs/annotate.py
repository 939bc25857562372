"""Annotation: trajectories -> clause-level preference tuples, written as an ArrayRecord TFDS dataset.

Spider (or BIRD) layout in ``data.manual_dir`` (dev.json / train_spider.json, tables.json,
database/<db>/<db>.sqlite, optional predictions_<split>.jsonl):

    python -m caper_jax.annotate build --config=configs/annotate.py:spider \
        --config.data.manual_dir=/work/shared/data/spider --config.data_dir=/tmp/caper_tfds

The built-in demo world (no downloads; built into ``data.manual_dir`` first when that is empty):

    python -m caper_jax.annotate build --config=configs/annotate.py:demo --config.data_dir=/tmp/caper_tfds

BIRD layout (dev.json or dev/dev.json, train/train.json, dev_tables.json, dev_databases/<db>/<db>.sqlite,
train_databases/; the :bird variant sets BIRD's semantics and a query budget of about its 30 s):

    python -m caper_jax.annotate build --config=configs/annotate.py:bird \
        --config.data.manual_dir=/data/bird/dev --config.data_dir=/tmp/caper_tfds

Variants (``:arg``, comma separated): ``spider`` | ``demo`` | ``bird`` (data source), ``limit=N``
(per split, at most N gold questions and at most N lines of its predictions file, so up to 2N
trajectories; 0 = all), ``per_query=K``.

Defaults and why (docs/annotation.md has the full argument):
  alpha = 1.0         penalty at v*; the scale of every margin. 1 keeps margins in (0, 1].
  sigma = 1.0         decay length in tree edges: a parent gets exp(-1/2) = 0.61 of the root's
                      penalty, a grandparent exp(-2) = 0.14, three edges away 0.011.
  margin_floor = 0.05 keeps positions up to two edges from v* (>= 0.135) and drops the numerically
                      negligible tail (three or more edges, <= 0.011).
  reference_edges     False: the paper's rule, the penalty travels up v*'s ancestors only, so it
                      stays in the clause holding v*. True also lets a column reach the table it
                      reads (a wrong column marks FROM with 0.61); a pair whose two clause texts
                      are then equal is dropped (docs/annotation.md section 5).
  within_trajectory   also compare each clause of a negative query with its own root clause
                      (our extension beyond the paper, docs/annotation.md section 5); False gives the
                      paper's same-position tuples only, for the ablation.
  per_query = 4       fault-injection negatives per gold query: on Spider dev 13.1 tuples per gold
                      query (4.7 without within_trajectory).
  compound = 0        how many of them also get a second fault in a later clause, the root still
                      the first (our extension, docs/annotation.md section 5); 0 is the paper's
                      single-fault recipe.
  site_balance        the order edit sites are tried in: "clause" (round-robin over the query's
                      clauses, then kinds) spreads a query's negatives over its clauses; "kind"
                      (over mutation kinds) is the order before 2026-11-30; docs/annotation.md section 5.
"""
from ml_collections import ConfigDict

from caper_jax.sql.tuples import AnnotationSettings
from configs.common import parse_arg


def get_config(arg: str | None = None) -> ConfigDict:
    arg = parse_arg(arg, spider=False, demo=False, bird=False, limit=0, per_query=AnnotationSettings().per_query)
    if arg.spider + arg.demo + arg.bird > 1:
        raise ValueError("choose one of :spider, :demo and :bird")
    c = ConfigDict()
    c.name = "demo" if arg.demo else "bird" if arg.bird else "spider"   # TFDS config name prefix
    c.data_dir = ""                              # TFDS data_dir; empty: ~/tensorflow_datasets

    c.data = ConfigDict()
    c.data.manual_dir = ""                       # Spider/BIRD layout; demo: built here when empty
    c.data.splits = ("dev",) if not arg.demo else ("train", "dev")
    c.data.limit = arg.limit                     # per split: N questions + N prediction lines (0 = all)
    c.data.predictions = True                    # also read predictions_<split>.jsonl if present
    c.data.demo_seed = 0
    # "" = the layout's database folders (caper_jax/data/spider.py: database/, <split>_databases/,
    # <split>/<split>_databases/); else a folder under manual_dir, "{split}" replaced.
    c.data.database_dir = ""

    # Each default lives once, in the annotator's own AnnotationSettings (the docstring above says why
    # each value); this config writes only its variants' choices.
    recipe = AnnotationSettings()
    c.alpha = recipe.alpha
    c.sigma = recipe.sigma
    c.margin_floor = recipe.margin_floor
    c.reference_edges = recipe.reference_edges   # the paper's rule: ancestors only
    c.within_trajectory = recipe.within_trajectory   # + (clause k) > (root clause) of the same negative
    c.per_query = arg.per_query
    c.compound = recipe.compound                 # of those, negatives also given a second, later fault
    c.site_balance = recipe.site_balance         # edit sites tried round-robin over clauses (or: kind)
    c.max_attempts = 0                           # mutants executed per gold; 0: 8 * per_query
    c.semantics = "bird" if arg.bird else recipe.semantics   # result equivalence (bird: set equality)
    c.suspect_tuples = recipe.suspect_tuples                     # tuples from suspect failures (tie, type, gold_literal_case)
    # Per query: a budget of SQLite VM instructions (reproducible: it does not depend on the machine's
    # load) and a wall-clock backstop. Spider: 50 M instructions, 0.4–2 s of SQLite; BIRD's evaluator
    # allows 30 s, about 1 G instructions.
    c.max_vm_steps = 1_000_000_000 if arg.bird else recipe.max_vm_steps
    c.timeout_s = 600.0 if arg.bird else recipe.timeout_s
    c.max_rows = recipe.max_rows
    c.seed = recipe.seed
    return c
