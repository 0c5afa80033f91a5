"""Hugging Face classes of the model family, registered with the Auto classes on import."""

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from .configuration import MoEPluginConfig
from .modeling import MoEPluginForCausalLM, MoEPluginModel, MoEPluginPreTrainedModel
from .modeling_vl import MoEPluginForConditionalGeneration
from .presets import PRESETS, preset_config
from .processing import MoEProcessor
from .tokenizer import ByteTokenizer

AutoConfig.register(MoEPluginConfig.model_type, MoEPluginConfig, exist_ok=True)
AutoModelForCausalLM.register(MoEPluginConfig, MoEPluginForCausalLM, exist_ok=True)
AutoModelForImageTextToText.register(MoEPluginConfig, MoEPluginForConditionalGeneration, exist_ok=True)
AutoTokenizer.register(MoEPluginConfig, slow_tokenizer_class=ByteTokenizer, exist_ok=True)

__all__ = ["ByteTokenizer", "MoEPluginConfig", "MoEPluginForCausalLM", "MoEPluginForConditionalGeneration",
           "MoEPluginModel", "MoEPluginPreTrainedModel", "MoEProcessor", "PRESETS", "preset_config"]
