"""The recipe: one JSON file that says which model, which adapters, which data, how to train and where to
write, validated when it is read (``schema.load_recipe``), and the model it names resolved once
(``resolved_model.resolve_model``). The trainer, the planner and the exporter all read it from here."""
