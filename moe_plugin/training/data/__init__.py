"""A run's data: records read from plain text, chat or image+text files (``records``, ``chat``, ``images``), rendered
with the base's own chat template (``chat_template``), packed into rows and cut into each step's micro-batches
(``pipeline``)."""
