"""Everything that knows ranks: process groups and the multi-process launcher."""
