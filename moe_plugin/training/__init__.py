"""Training: the recipe schema and loader, the data pipeline, the loop with its model backends, checkpoints,
logging and export. ``moe_plugin.train`` (the ``moe-plugin train`` command) is the entry point."""
