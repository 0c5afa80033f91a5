"""Hugging Face classes of the model family, registered with the Auto classes on import."""

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from .configuration import MoEPluginConfig
from .modeling import MoEPluginForCausalLM, MoEPluginModel, MoEPluginPreTrainedModel
from .modeling_vl import MoEPluginForConditionalGeneration
from .presets import PRESETS, preset_config
from .processing import MoEProcessor
from .tokenizer import ByteTokenizer
from .k3_config import KimiK3Config
from .k3_format import (
    A_LOG_PAD_MULTIPLE,
    a_log_padded_length,
    config_from_k3,
    config_to_k3,
    load_k3_checkpoint,
    save_k3_checkpoint,
    state_dict_from_k3,
    state_dict_to_k3,
)


class _CausalLMByArchitectures:
    """AutoModelForCausalLM's entry for ``MoEPluginConfig``: the image+text model when the config's
    ``architectures`` names it, else the text model.

    transformers' own two-class entry (a tuple) iterates ``config.architectures`` and fails on ``None``, which is
    what every config built in code (``preset_config``) carries, so ``from_config`` would raise a TypeError."""

    config_class = MoEPluginConfig

    @staticmethod
    def pick(config) -> type:
        names = getattr(config, "architectures", None) or ()
        return (
            MoEPluginForConditionalGeneration
            if MoEPluginForConditionalGeneration.__name__ in names
            else MoEPluginForCausalLM
        )

    @classmethod
    def _from_config(cls, config, **kwargs):
        return cls.pick(config)._from_config(config, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        return cls.pick(config).from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)


class _K3Models(_CausalLMByArchitectures):
    """The Auto model classes' entry for the published ``KimiK3Config``: the image+text model when the config has
    a vision tower (the release's ``architectures`` name its own remote class, which is left as it is)."""

    config_class = KimiK3Config

    @staticmethod
    def pick(config) -> type:
        return MoEPluginForConditionalGeneration if config.vision_config is not None else MoEPluginForCausalLM


AutoConfig.register(MoEPluginConfig.model_type, MoEPluginConfig, exist_ok=True)
# the published K3 config.json ("kimi_k3", its auto_map naming remote code the directory may not hold) reads as
# this project's KimiK3Config: a class registered from outside transformers wins over auto_map, with or without
# trust_remote_code (docs/k3-formats.md, "The release as downloaded: config")
AutoConfig.register(KimiK3Config.model_type, KimiK3Config, exist_ok=True)
# an image base loads whole under AutoModelForCausalLM (as transformers' own image+text models do), e.g. under
# peft's AutoPeftModelForCausalLM, which builds its base with that class
AutoModelForCausalLM.register(MoEPluginConfig, _CausalLMByArchitectures, exist_ok=True)
AutoModelForImageTextToText.register(MoEPluginConfig, MoEPluginForConditionalGeneration, exist_ok=True)
AutoModelForCausalLM.register(KimiK3Config, _K3Models, exist_ok=True)
AutoModelForImageTextToText.register(KimiK3Config, _K3Models, exist_ok=True)
AutoTokenizer.register(MoEPluginConfig, slow_tokenizer_class=ByteTokenizer, exist_ok=True)

__all__ = [
    "A_LOG_PAD_MULTIPLE",
    "ByteTokenizer",
    "KimiK3Config",
    "MoEPluginConfig",
    "MoEPluginForCausalLM",
    "MoEPluginForConditionalGeneration",
    "MoEPluginModel",
    "MoEPluginPreTrainedModel",
    "MoEProcessor",
    "PRESETS",
    "a_log_padded_length",
    "config_from_k3",
    "config_to_k3",
    "load_k3_checkpoint",
    "preset_config",
    "save_k3_checkpoint",
    "state_dict_from_k3",
    "state_dict_to_k3",
]
