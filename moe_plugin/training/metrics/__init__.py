"""What a run reports: the logger interface and its console, plot and W&B implementations (``logger``,
``run_logger``, ``load_plot``, ``wandb_logger``), the MoE metrics (``moe``, ``routing``) and the held-out answers
(``answer_eval``)."""
