"""moe_plugin: LoRA fine-tuning of ultra-large mixture-of-experts models (Stable Latent MoE, KDA + Gated DSA).

Importing the package registers the Hugging Face classes with the Auto classes.
"""

from .models import (MoEPluginConfig, MoEPluginForCausalLM, MoEPluginForConditionalGeneration, MoEProcessor,
                     preset_config)

__version__ = "0.1.0"
__all__ = ["MoEPluginConfig", "MoEPluginForCausalLM", "MoEPluginForConditionalGeneration", "MoEProcessor",
           "preset_config", "__version__"]
