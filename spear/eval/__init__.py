"""Evaluation: perplexity on held-out text (perplexity.py), bytes of models and compensators
(memory.py), result tables and JSON (report.py)."""
