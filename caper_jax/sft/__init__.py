"""Supervised fine-tuning of the text-to-SQL policy (docs/sft.md): data pipeline and training loop."""
