"""Everything that knows ranks: process groups, expert parallelism and ZeRO-3 (the multi-process test
launcher is ``moe_plugin.testing.launch``)."""
