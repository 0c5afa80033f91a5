"""The test and benchmark harness: code that tests/ and benchmarks/ run, and nothing else in moe_plugin imports.

It ships with the package so that the ranks ``run_distributed`` starts (``python -m moe_plugin.testing.launch``)
and the benchmarks import it by module path from any working directory, but it is no part of the product: the
trainer, the commands and the planner never import it (tests/test_import_layers.py holds it in the top tier,
above the entry points). Its modules:

- ``launch``: ``run_distributed``, one function on N local processes joined by torch.distributed;
- ``plan_measure``: the planner's measured check, the tensor peaks of tiny layouts trained for real through the
  ``Trainer`` (docs/planner.md, "Checked against measurements");
- ``grad_reduce``: ``reduce_gradients``, the data + expert-parallel gradient reduction of a bare megatron model
  (the trainer's ZeRO-3 reduces over the expert groups itself, ``parallel.layout``);
- ``megatron_loading``: a bare megatron ``GPTModel``'s loaders per EP rank (Hugging Face and K3 checkpoints,
  adapters under Hugging Face names), which the megatron tests' rank code calls;
- ``packed_checkpoints``: writers of the published packed-expert layout, and the tiny packed checkpoints (with
  a dequantised fp32 twin) that the packed-expert tests load;
- ``k3_release``: ``write_k3_release``, a tiny Kimi K3 base in the release's exact format (the published
  config.json shrunk with every key kept, the release's tensor names and dtypes, MXFP4 experts, the K3 tokenizer
  fixture copied in), written from the published facts in tests/fixtures/k3/.
"""
