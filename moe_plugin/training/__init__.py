"""Training: a recipe (``moe_plugin.recipe``) becomes a run here. The run itself is this package's top level
(``loop``, ``checkpoint``, ``engine_state``, ``run_dir``, ``runtime``, ``ds_config``, ``schedule``, ``guards``,
``exporting``, ``inputs``) with its model faces in ``backends/``; the data pipeline is ``data/``, what a run
reports ``metrics/``. ``moe_plugin.train`` (the ``moe-plugin train`` command) is the entry point."""
