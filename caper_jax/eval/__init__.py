"""Evaluation of trained models: checkpoint loading for inference, policy EX / MV@k / PRM reranking."""
