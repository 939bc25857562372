"""The synthetic demo world: a text-to-SQL dataset built offline, with no downloads (docs/demo_world.md).

    schemas.py      the five databases: tables, column roles, seeded row generators
    templates.py    question templates, addressed by column role, and the train/dev split
    predictions.py  imperfect predictions, each with a known root-cause clause
    world.py        generation and the Spider-layout files (``build_demo_world``)

The world is read back by the same Spider/BIRD readers as real data (``caper_jax.data.spider``).
Its tokenizer is not here: ``caper_jax.data.tokenizer`` trains the one byte-level BPE of every
world, the demo world's (its default corpus, drawn from this package) and the Spider view's
(``experiments.spider_verifier.build_spider_view`` passes Spider's prompts + SQL), so it stays with the data layer.
"""
