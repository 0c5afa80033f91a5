"""Generators of the shipped demo data and bases, run from the repository root (``python -m examples.<name>``):
``shapes`` (pictures of a coloured shape), ``shape_tasks`` (the main job's data) and ``subword_base`` (the
``recipes/bases/tiny-subword`` base). Not part of the installed package."""
