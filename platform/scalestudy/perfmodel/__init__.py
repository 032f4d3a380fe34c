"""Analytical performance model. Pure Python: imports neither torch nor ray (a test enforces it)."""
