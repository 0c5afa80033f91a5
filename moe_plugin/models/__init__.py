"""Hugging Face classes of the model family, registered with the Auto classes on import."""

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from .configuration import MoEPluginConfig
from .modeling import MoEPluginForCausalLM, MoEPluginModel, MoEPluginPreTrainedModel
from .modeling_vl import MoEPluginForConditionalGeneration
from .presets import PRESETS, preset_config
from .processing import MoEProcessor
from .tokenizer import ByteTokenizer
from .k3_format import (A_LOG_PAD_MULTIPLE, a_log_padded_length, config_from_k3, config_to_k3, load_k3_checkpoint,
                        save_k3_checkpoint, state_dict_from_k3, state_dict_to_k3)

AutoConfig.register(MoEPluginConfig.model_type, MoEPluginConfig, exist_ok=True)
# transformers picks between the two by the checkpoint's `architectures` (as it does for its own image+text
# models under AutoModelForCausalLM), so an image base loads whole, e.g. under peft's AutoPeftModelForCausalLM
AutoModelForCausalLM.register(MoEPluginConfig, (MoEPluginForCausalLM, MoEPluginForConditionalGeneration),
                              exist_ok=True)
AutoModelForImageTextToText.register(MoEPluginConfig, MoEPluginForConditionalGeneration, exist_ok=True)
AutoTokenizer.register(MoEPluginConfig, slow_tokenizer_class=ByteTokenizer, exist_ok=True)

__all__ = ["A_LOG_PAD_MULTIPLE", "ByteTokenizer", "MoEPluginConfig", "MoEPluginForCausalLM",
           "MoEPluginForConditionalGeneration", "MoEPluginModel", "MoEPluginPreTrainedModel", "MoEProcessor",
           "PRESETS", "a_log_padded_length", "config_from_k3", "config_to_k3", "load_k3_checkpoint",
           "preset_config", "save_k3_checkpoint", "state_dict_from_k3", "state_dict_to_k3"]
