"""Hugging Face model classes for the text model, composed from ``moe_plugin.layers``.

Names follow K3 (docs/architecture.md 7): ``model.embed_tokens``, ``model.layers.{i}``, ``model.norm``,
``lm_head``, and with Attention Residuals ``model.output_attn_res_{proj,norm}``.

Padding: the attention layers work on packed sequences, so a padded batch (an ``attention_mask`` with
zeros, each row's real tokens contiguous) is packed into one row with ``cu_seqlens`` and unpacked after
the last layer; the result equals running every row alone (``inputs.py``). With a cache (generation) the
batch stays padded instead: only left padding is allowed, and the layers keep padded tokens out of their
state and keys (``token_mask``), so every row generates what it would alone.

Precision: the policy of ``moe_plugin.precision`` (docs/precision.md): KDA's ``A_log``/``dt_bias``, the router
and its selection bias stay fp32 through ``model.to(bfloat16)`` and ``from_pretrained(dtype=bfloat16)``.
Loading is strict: a checkpoint that does not fit the config raises a ValueError naming the first tensors
that differ (``strict=False`` to skip that).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from ..config import require
from ..layers.attention_inputs import describe_inputs
from ..layers.attn_res import attn_res_point, make_stream, stream_from_state
from ..layers.decoder import DecoderLayer
from ..layers.moe import MoERouter, balancing
from ..layers.norm import RMSNorm
from ..layers.recompute import check_mode, set_recompute
from ..layers.vision import VisionTower
from ..ops.context import ContextSlice, refuse_with_context
from ..ops.losses import balance_terms, training_loss
from ..ops.moe import document_weights
from ..precision import FP32_TENSORS, keep_fp32_through
from .cache import HybridCache
from .configuration import MoEPluginConfig
from .loading import SELF_INITIALISED, check_loading_info, is_k3_layout, load_k3_layout, reset_unloaded
from .inputs import check_inputs, check_labels, left_padding_mask, pack_padded, unpack_padded


@dataclass
class MoEModelOutput(ModelOutput):
    """last_hidden_state ``[B, T, D]``; expert_load ``[num_moe_layers, E]`` token counts; indexer_loss scalar."""

    last_hidden_state: Optional[torch.Tensor] = None
    cache: Optional[HybridCache] = None
    expert_load: Optional[torch.Tensor] = None
    indexer_loss: Optional[torch.Tensor] = None


@dataclass
class MoECausalLMOutput(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    cache: Optional[HybridCache] = None
    expert_load: Optional[torch.Tensor] = None
    indexer_loss: Optional[torch.Tensor] = None
    balance_loss: Optional[torch.Tensor] = None  # [num_moe_layers]: each layer's balance term (no coefficient)


class MoEPluginPreTrainedModel(PreTrainedModel):
    config_class = MoEPluginConfig
    base_model_prefix = "model"
    # activation checkpointing through transformers' switch (the HF Trainer's gradient_checkpointing=True):
    # layers.recompute's mode, the routing kept (activation_checkpointing_enable)
    supports_gradient_checkpointing = True
    recompute_mode_on_enable = "full"
    _no_split_modules = ["DecoderLayer"]
    _keep_in_fp32_modules_strict = list(FP32_TENSORS)

    @classmethod
    def from_pretrained(cls, *args, strict: bool = True, **kwargs):
        """transformers' ``from_pretrained``; with ``strict`` (the default) a checkpoint whose tensor names or
        shapes differ from the config raises a ValueError naming the first of them, instead of a warning. A local
        directory in K3's published layout (the release's config.json, per-expert and packed experts) loads
        through the project's read planner (``loading.load_k3_layout``), with the same keywords. A local
        directory is recorded by its absolute path (``model.name_or_path``): peft's ``get_peft_model`` copies it
        into the adapter's ``base_model_name_or_path``, which ``AutoPeftModelForCausalLM`` opens from the loading
        process's working directory, where a relative path would name nothing."""
        path = args[0] if args else kwargs.pop("pretrained_model_name_or_path", None)
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
            path = os.path.abspath(path)
        if is_k3_layout(path):
            loaded = load_k3_layout(cls, path, strict=strict, **kwargs)
        elif not strict:
            loaded = super().from_pretrained(path, *args[1:], **kwargs)
        else:
            want_info = kwargs.pop("output_loading_info", False)
            ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
            # load with mismatches allowed so that transformers reports them all, then decide here
            model, info = super().from_pretrained(
                path, *args[1:], ignore_mismatched_sizes=True, output_loading_info=True, **kwargs
            )
            check_loading_info(info, list(model.state_dict()), ignore_mismatched)
            loaded = (model, info) if want_info else model
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.generation_rules()  # the checkpoint's generation_config.json replaced the one __init__ made
        return loaded

    def generation_rules(self) -> None:
        """What generation must obey whatever ``generation_config.json`` says (the image+text model: never emit an
        image placeholder); nothing for the text model."""

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) / .half() follow the precision policy: its fp32 tensors keep their exact values
        return keep_fp32_through(self, lambda: super(MoEPluginPreTrainedModel, self)._apply(fn, recurse))

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False
    ):
        """transformers' switch onto ``layers.recompute``: mode ``"full"``, or ``activation_checkpointing_kwargs
        ["mode"]`` (``"selective"``); the other keys go to ``torch.utils.checkpoint.checkpoint``, always
        non-reentrant (``use_reentrant=True`` is refused)."""
        kwargs = dict(activation_checkpointing_kwargs or {})
        mode = check_mode(kwargs.pop("mode", "full"), "activation_checkpointing_kwargs.mode")
        if kwargs.setdefault("use_reentrant", False):
            raise ValueError(
                "activation_checkpointing_kwargs.use_reentrant: must be False (reentrant checkpointing "
                "would recompute the router and breaks ZeRO-3's frozen parameters); drop it"
            )
        self.recompute_mode_on_enable = mode
        return super().activation_checkpointing_enable(kwargs, every_n_layers=every_n_layers, offload=offload)

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1
    ) -> None:
        # transformers' hook (enable and disable): every every_n_layers-th decoder layer (and its MoE) takes the
        # mode with transformers' checkpoint function; a vision tower recomputes only when it trains
        mode = self.recompute_mode_on_enable if enable else "off"
        layers = [m for m in self.modules() if isinstance(m, DecoderLayer)]
        for i, layer in enumerate(layers):
            set_recompute(layer, mode if i % max(1, every_n_layers) == 0 else "off", gradient_checkpointing_func)
        for tower in (m for m in self.modules() if isinstance(m, VisionTower)):
            set_recompute(tower, mode)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own HybridCache (recurrent state + latent kv)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, SELF_INITIALISED):
            reset_unloaded(module)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, MoERouter):
                nn.init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class MoEPluginModel(MoEPluginPreTrainedModel):
    def __init__(self, config: MoEPluginConfig):
        super().__init__(config)
        mc = config.to_model_config()
        self.model_config = mc
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(mc, i) for i in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        if mc.attn_res:
            self.output_attn_res_proj, self.output_attn_res_norm = attn_res_point(mc.hidden_size, mc.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def new_cache(self) -> HybridCache:
        return HybridCache([layer.new_cache() for layer in self.layers])

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        cache: Optional[HybridCache] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        return_indexer_loss: bool = False,
        context: Optional[ContextSlice] = None,
        **kwargs,
    ) -> MoEModelOutput:
        """input_ids ``[B, T]`` or inputs_embeds ``[B, T, D]``; attention_mask ``[B, T]`` (1 real, 0 padding);
        cu_seqlens ``[N+1]`` for packed rows (B = 1). context: under context parallelism this rank's
        ``ContextSlice`` (``training.context_rows``), the inputs its slice of the row, whose documents it carries
        (no cu_seqlens, padding or cache then). Bad input raises a ValueError naming the argument."""
        mc = self.model_config
        if context is not None:
            refuse_with_context(cu_seqlens=cu_seqlens, cache=cache, use_cache=use_cache or None)
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                refuse_with_context(attention_mask=attention_mask)
        batch, length = check_inputs(
            input_ids,
            inputs_embeds,
            attention_mask,
            mc.vocab_size,
            mc.hidden_size,
            cache.seq_length if cache is not None else 0,
        )
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and cache is None:
            cache = self.new_cache()
        index = token_mask = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            if cu_seqlens is not None:
                raise ValueError("attention_mask: padding cannot be combined with cu_seqlens; pack only real tokens")
            if cache is not None:  # left padding, masked inside the layers (nothing to pack one step at a time)
                token_mask = left_padding_mask(attention_mask, length, cache.seq_length)
            else:
                x, cu_seqlens, index = pack_padded(x, attention_mask)
        # the token layout every attention layer of this forward reads, its combinations checked once here
        inputs = describe_inputs(*x.shape[:2], cu_seqlens, token_mask, context, decoding=cache is not None)

        residual = make_stream(x, mc.attn_res).state()  # tuples of tensors between modules (ZeRO-3's hooks)
        loads, index_losses = [], []
        for i, layer in enumerate(self.layers):
            residual, load, index_loss = layer(
                residual,
                cache=cache[i] if cache is not None else None,
                return_indexer_loss=return_indexer_loss,
                inputs=inputs,
            )
            if load is not None:
                loads.append(load)
            if index_loss is not None:
                index_losses.append(index_loss)
        stream = stream_from_state(residual, mc.attn_res, len(self.layers), mc.attn_res_block_size)
        if mc.attn_res:
            hidden = stream.read(self.output_attn_res_proj, self.output_attn_res_norm)
        else:
            hidden = stream.read()
        hidden = self.norm(hidden)
        if index is not None:
            hidden = unpack_padded(hidden, index, batch, length)
        if cache is not None:
            cache.seq_length += length
        return MoEModelOutput(
            last_hidden_state=hidden,
            cache=cache,
            expert_load=torch.stack(loads) if loads else None,
            indexer_loss=torch.stack(index_losses).mean() if index_losses else None,
        )


class MoEPluginForCausalLM(MoEPluginPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # used when tie_word_embeddings
    # DeepSeek-V3's sequence-wise balance loss, per document (moe_plugin.layers.moe.balancing), added to a
    # training loss with labels times this; a training setting (the recipe's router_balance.aux_loss_coeff,
    # which the trainer sets here), so not part of the config: 0 leaves it out
    router_aux_loss_coeff: float = 0.0

    def __init__(self, config: MoEPluginConfig):
        super().__init__(config)
        self.model = MoEPluginModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        cache: Optional[HybridCache] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
        num_items_in_batch: Optional[int] = None,
        context: Optional[ContextSlice] = None,
        **kwargs,
    ) -> MoECausalLMOutput:
        """Logits ``[B, T, V]`` (``[B, logits_to_keep, V]``) and, with labels, the next-token loss.

        input_ids ``[B, T]`` int (or inputs_embeds ``[B, T, D]``); attention_mask ``[B, T]``, 1 for real tokens
        and 0 for padding (each row's real tokens contiguous). labels ``[B, T]``: the input ids themselves,
        NOT shifted (position t is scored against label t+1), -100 where no loss is wanted; padding is
        ignored on its own. logits_to_keep: if > 0, only the last that many positions get logits (for
        generation; an error together with labels, since the loss needs every position). cu_seqlens ``[N+1]``
        int: boundaries of N documents packed into one row (B = 1); no prediction crosses a boundary.
        num_items_in_batch: the number of label tokens over all micro-batches of an optimizer step (as the
        Hugging Face Trainer passes it): the loss is then summed and divided by it instead of averaged.
        context: under context parallelism this rank's ``ContextSlice``: the inputs are its slice of the row and
        the logits those of the slice; the loss needs the whole row's labels and its balance terms the context
        group, so the caller composes it (``ops.losses.training_loss(..., context=context)``, as
        ``training.backends`` do) and labels must be None.
        """
        if context is not None:
            require(
                labels is None,
                "labels",
                "cannot be combined with a context: the loss of a slice needs the whole row's labels; compute "
                "it with moe_plugin.ops.losses.training_loss(logits, labels, ..., context=context)",
            )
        if labels is not None:  # fail before the forward, not inside the loss
            mc = self.model.model_config
            batch, length = check_inputs(
                input_ids,
                inputs_embeds,
                attention_mask,
                mc.vocab_size,
                mc.hidden_size,
                cache.seq_length if cache is not None else 0,
            )
            check_labels(labels, batch, length, mc.vocab_size, logits_to_keep)
        # the indexer learns only from its KL loss (its inputs are detached): compute it when it can learn
        want_indexer_loss = (
            self.training
            and self.config.indexer_loss_coeff > 0
            and any(p.requires_grad for p in self.indexer_parameters())
        )
        with self._balancing(labels, attention_mask, cu_seqlens, cache, num_items_in_batch) as moe_layers:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                cache=cache,
                use_cache=use_cache,
                cu_seqlens=cu_seqlens,
                return_indexer_loss=want_indexer_loss,
                context=context,
            )
        balance = balance_terms([layer.pop_balance() for layer in moe_layers])
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if attention_mask is not None:
                labels = labels.masked_fill(~attention_mask.bool(), -100)
            loss = training_loss(
                logits,
                labels,
                cu_seqlens,
                num_items_in_batch,
                out.indexer_loss if want_indexer_loss else None,
                self.config.indexer_loss_coeff,
                balance,
                self.router_aux_loss_coeff,
            )
        return MoECausalLMOutput(
            loss=loss,
            logits=logits,
            cache=out.cache,
            expert_load=out.expert_load,
            indexer_loss=out.indexer_loss,
            balance_loss=balance,
        )

    def _balancing(self, labels, attention_mask, cu_seqlens, cache, num_items_in_batch):
        """``layers.moe.balancing`` over this model's MoE layers for a training forward with labels and a
        positive ``router_aux_loss_coeff`` (a nullcontext yielding no layer otherwise). A document is a packed
        document of ``cu_seqlens`` or a row; padding (attention_mask 0) does not count, and each document's term
        is weighted by its scored labels over ``num_items_in_batch`` (``ops.moe.document_weights``)."""
        if not (self.training and self.router_aux_loss_coeff > 0 and labels is not None and cache is None):
            return contextlib.nullcontext([])
        if attention_mask is not None:
            labels = labels.masked_fill(~attention_mask.bool(), -100)
        doc_ids, weights = document_weights(labels, cu_seqlens, num_items_in_batch)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            # the model packs the real tokens of a padded batch into one row (pack_padded): only they are routed
            doc_ids = doc_ids[attention_mask.reshape(-1).bool()]
        layers = [layer.block_sparse_moe for layer in self.model.layers if layer.is_moe]
        return balancing(layers, doc_ids, weights)

    def indexer_parameters(self):
        """The DSA lightning indexers' parameters (trained by the indexer KL loss alone)."""
        return (p for name, p in self.named_parameters() if ".self_attn.indexer." in name)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: Optional[HybridCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        # after the prefill the cache holds every earlier position: feed only what it has not seen
        seen = cache.seq_length if cache is not None else 0
        inputs = {"input_ids": input_ids[:, seen:], "cache": cache, "use_cache": kwargs.get("use_cache", True)}
        if kwargs.get("logits_to_keep"):
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]  # the prefill needs the last position only
        if attention_mask is not None:  # every step: a left-padded prompt needs it in the prefill and after
            inputs["attention_mask"] = attention_mask
        return inputs
