"""Every reach into transformers' internals (tested with transformers 5.24.0, the pin of setup.cfg).

* ``Trainer._save(output_dir, state_dict=...)``: the Trainer's own writer, which ``hf_trainer.MoETrainer`` calls
  with the whole adapter it gathered over the expert-parallel ranks (``save_trainer_output``); the public
  ``save_model`` would gather only rank 0's experts.
* ``transformers.initialization.no_init_weights``: skips the post-init weight draws while a model is built
  under ZeRO-3 for a checkpoint that overwrites every weight, as transformers' own ``from_pretrained`` does
  (``no_init_weights``).
* ``transformers.utils.hub.convert_file_size_to_int``: the ``"5GB"`` shard-size parser of ``save_pretrained``,
  so the project's shard sizes read as transformers' do (``convert_file_size_to_int``).

``check()`` verifies each of those names once at start-up (``moe_plugin.compat.check_all``).
"""

from __future__ import annotations

import inspect

from ._upstream import missing, resolve

__all__ = ["TESTED_TRANSFORMERS", "check", "save_trainer_output", "no_init_weights", "convert_file_size_to_int"]

TESTED_TRANSFORMERS = "5.24.0"
_DIST = "transformers"
_SAVE = ("transformers", "Trainer._save")
_NO_INIT = ("transformers.initialization", "no_init_weights")
_FILE_SIZE = ("transformers.utils.hub", "convert_file_size_to_int")


def _resolve(module: str, attr: str = ""):
    return resolve("transformers", _DIST, TESTED_TRANSFORMERS, module, attr)


def save_trainer_output(trainer, output_dir: str, state_dict) -> None:
    """Write ``state_dict`` (the model's, or its adapter's) to ``output_dir`` the way ``trainer`` saves a model
    (``Trainer._save``: peft's ``save_pretrained`` for a peft model, the tokenizer, the training arguments)."""
    trainer._save(output_dir, state_dict=state_dict)


def no_init_weights():
    """transformers' context manager that skips the weight initialisation of models built inside it."""
    return _resolve(*_NO_INIT)()


def convert_file_size_to_int(size) -> int:
    """A size as ``save_pretrained``'s ``max_shard_size`` takes it (``"5GB"``, ``"200MB"``, an int) in bytes."""
    return _resolve(*_FILE_SIZE)(size)


def check() -> None:
    """Every transformers name this module uses exists in the installed transformers (RuntimeError naming the
    first that does not, the installed version and ``TESTED_TRANSFORMERS``)."""
    save = _resolve(*_SAVE)
    if "state_dict" not in inspect.signature(save).parameters:
        raise missing("transformers", _DIST, TESTED_TRANSFORMERS, ".".join(_SAVE), "takes no state_dict argument")
    _resolve(*_NO_INIT)
    _resolve(*_FILE_SIZE)
