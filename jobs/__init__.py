"""Entry points: `python -m jobs.<name>` (also under `ray job submit`)."""
