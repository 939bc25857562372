"""The experiments: pipelines of the project's own trainers and evaluator, each a list of named stages.

    miniature        the paper's experiment in miniature (configs/reproduce.py, trainer="reproduce")
    spider_verifier  the Clause-PRM as a verifier of six published systems on Spider
                     (configs/spider_verifier.py, trainer="spider_verifier")
    stages           Stage(name, output, function) and the runner that skips a stage whose output exists
    samples          the SFT policy's samples of training questions and the PRM's data built from them
    rerankers        the PRM rerankers and the one picked on training questions
    report           results.md / results.json, plots and the statistics they print

The top layer: these modules import the trainers, the evaluator and everything below; nothing below
imports them. ``caper_jax.train`` runs a pipeline as it runs a trainer (``validate``, ``run``, ``dry_run``).
"""
