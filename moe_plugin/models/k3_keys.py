"""K3's text config keys (``text_config``, ``model_type`` "kimi_linear") <-> ``MoEPluginConfig``'s keys, both ways
(docs/k3-formats.md, "The release as downloaded: config"; docs/architecture.md 2.3).

K3's text config uses the same key names as ``MoEPluginConfig`` wherever the two have the same knob; the
differences handled here are:

- the layer schedule: K3 lists ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-indexed), this
  project keeps one ``layer_types`` entry per layer;
- Attention Residuals: on in K3 exactly when ``attn_res_block_size`` is present (not null);
- grouped routing: K3 switches it with ``use_grouped_topk``; off means one group;
- keys whose only supported value is K3's (``moe_router_activation_func`` "sigmoid", ``moe_layer_freq`` 1,
  ``mla_use_nope`` true, ``linear_attn_config.use_full_rank_gate`` true): anything else is a ValueError
  naming the key;
- the DSA indexer: K3 has none, so it is off unless the config asks for it (this project's extension keys);
- multi-token prediction (``num_nextn_predict_layers``): accepted, but the model has no MTP layers (their
  tensors are handled by the state-dict adapter, ``k3_format``);
- the routed experts' storage: ``quantization_config`` (``k3_quant``).

Keys the model does not need (``architectures``, ``max_position_embeddings``, ``top_k``, ...) are not read
here; ``k3_config.KimiK3Config`` keeps them and writes them back unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from ..config import K3_TEXT_MODEL_TYPE
from .k3_quant import expert_format_from_k3, quantization_config_for

__all__ = ["SAME_KEYS", "TOKEN_KEYS", "EXTENSION_KEYS", "text_kwargs", "text_config_of"]

_REQUIRED = object()
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# K3 keys copied unchanged (same name, same meaning in MoEPluginConfig), with the default used when absent
SAME_KEYS: Dict[str, Any] = {
    "vocab_size": _REQUIRED,
    "hidden_size": _REQUIRED,
    "num_hidden_layers": _REQUIRED,
    "num_attention_heads": _REQUIRED,
    "rms_norm_eps": 1e-5,
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "q_lora_rank": _REQUIRED,
    "kv_lora_rank": _REQUIRED,
    "qk_nope_head_dim": _REQUIRED,
    "qk_rope_head_dim": _REQUIRED,
    "v_head_dim": _REQUIRED,
    "mla_use_output_gate": False,
    "num_experts": _REQUIRED,
    "num_experts_per_token": _REQUIRED,
    "num_shared_experts": 0,
    "moe_intermediate_size": _REQUIRED,
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 0,
    "intermediate_size": 0,
    "tie_word_embeddings": False,
}
# this project's keys that K3 lacks; written by text_config_of and read back, so a round trip keeps them
EXTENSION_KEYS = ("use_dsa_indexer", "index_topk", "index_n_heads", "index_head_dim")
_HIDDEN_ACT = {"situ": "situ", "silu": "swiglu", "swiglu": "swiglu"}


def _get(cfg: Mapping[str, Any], key: str, where: str, default: Any = _REQUIRED) -> Any:
    value = cfg.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"{where}{key}: required in a K3 config, but it is missing")
    return value


def _expect(cfg: Mapping[str, Any], key: str, where: str, supported: Any, default: Any) -> None:
    value = cfg.get(key, default)
    if value != supported:
        raise ValueError(f"{where}{key}: only {supported!r} is supported, got {value!r}")


def _layer_types(lin: Mapping[str, Any], num_layers: int, where: str) -> List[str]:
    kda, full = lin.get("kda_layers"), lin.get("full_attn_layers")
    if kda is None and full is None:
        raise ValueError(f"{where}linear_attn_config.full_attn_layers: required (with or instead of kda_layers)")
    every = set(range(1, num_layers + 1))
    full_set = set(full) if full is not None else every - set(kda)
    kda_set = set(kda) if kda is not None else every - full_set
    for key, layers in (("full_attn_layers", full_set), ("kda_layers", kda_set)):
        outside = sorted(i for i in layers if i not in every)
        if outside:
            raise ValueError(
                f"{where}linear_attn_config.{key}: entries are 1-indexed layers in [1, {num_layers}], got {outside}"
            )
    if kda_set & full_set or kda_set | full_set != every:
        raise ValueError(
            f"{where}linear_attn_config.kda_layers: with full_attn_layers it must list every layer "
            f"1..{num_layers} exactly once; both: {sorted(kda_set & full_set)}, neither: "
            f"{sorted(every - kda_set - full_set)}"
        )
    return ["mla" if i in full_set else "kda" for i in range(1, num_layers + 1)]


def text_kwargs(text: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """``MoEPluginConfig`` keyword arguments of K3's text config ``text``; ValueError naming ``<where><key>``
    for a missing or unsupported value."""
    kwargs = {key: _get(text, key, where, default) for key, default in SAME_KEYS.items()}
    kwargs.update({key: text[key] for key in TOKEN_KEYS + EXTENSION_KEYS if key in text})
    kwargs.setdefault("use_dsa_indexer", False)  # K3 has no indexer; asking for one starts it fresh
    kwargs["expert_format"] = expert_format_from_k3(text, where)  # packed routed experts (quantization_config)

    act = text.get("hidden_act", "situ")
    if act not in _HIDDEN_ACT:
        raise ValueError(f"{where}hidden_act: expected one of {sorted(_HIDDEN_ACT)}, got {act!r}")
    kwargs["hidden_act"] = _HIDDEN_ACT[act]
    block = text.get("attn_res_block_size")
    kwargs["attn_res"] = block is not None
    if block is not None:
        kwargs["attn_res_block_size"] = block

    _expect(text, "moe_router_activation_func", where, "sigmoid", "sigmoid")
    _expect(text, "moe_layer_freq", where, 1, 1)
    _expect(text, "mla_use_nope", where, True, True)  # no rotary embedding exists in the model
    if text.get("use_grouped_topk", False):
        kwargs["num_expert_group"] = _get(text, "num_expert_group", where)
        kwargs["topk_group"] = _get(text, "topk_group", where)
    mtp = text.get("num_nextn_predict_layers", 0) or 0
    if not isinstance(mtp, int) or mtp < 0:
        raise ValueError(f"{where}num_nextn_predict_layers: must be a non-negative integer, got {mtp!r}")

    lin = _get(text, "linear_attn_config", where)
    lin_where = f"{where}linear_attn_config."
    _expect(lin, "use_full_rank_gate", lin_where, True, True)  # the low-rank g_a/g_b output gate is not built
    lower = lin.get("gate_lower_bound")
    kwargs["layer_types"] = _layer_types(lin, kwargs["num_hidden_layers"], where)
    kwargs["linear_attn_config"] = dict(
        num_heads=_get(lin, "num_heads", lin_where),
        head_dim=_get(lin, "head_dim", lin_where),
        short_conv_kernel_size=lin.get("short_conv_kernel_size", 4),
        # no lower bound is Kimi-Linear's softplus gate; the bound value is then unused
        gate_form=lin.get("gate_form", "k3" if lower is not None else "kimi_linear"),
        gate_lower_bound=lower if lower is not None else -5.0,
        gate_rank=lin.get("gate_rank"),
        chunk_size=lin.get("chunk_size", 64),
    )
    return kwargs


def text_config_of(config) -> Dict[str, Any]:
    """K3's text config for ``config`` (a ``MoEPluginConfig``): ``text_kwargs`` of it rebuilds ``config``. This
    project's knobs that K3 lacks (the DSA indexer, ``gate_form``, ``gate_rank``, ``chunk_size``) are written as
    extra keys, which K3 readers ignore."""
    c = config
    mc = c.to_model_config()
    lin = c.linear_attn_config
    text: Dict[str, Any] = {"model_type": K3_TEXT_MODEL_TYPE}
    text.update({key: getattr(c, key) for key in SAME_KEYS})
    text["hidden_act"] = c.hidden_act
    text["attn_res_block_size"] = c.attn_res_block_size if c.attn_res else None
    text["linear_attn_config"] = dict(
        kda_layers=[i + 1 for i, t in enumerate(mc.layer_types) if t == "kda"],
        full_attn_layers=[i + 1 for i, t in enumerate(mc.layer_types) if t == "mla"],
        num_heads=lin["num_heads"],
        head_dim=lin["head_dim"],
        short_conv_kernel_size=lin["short_conv_kernel_size"],
        gate_lower_bound=lin["gate_lower_bound"] if mc.kda.gate_form == "k3" else None,
        use_full_rank_gate=True,
        gate_form=mc.kda.gate_form,
        gate_rank=mc.kda.gate_rank,
        chunk_size=mc.kda.chunk_size,
    )
    text.update(
        mla_use_nope=True,
        moe_router_activation_func="sigmoid",
        moe_layer_freq=1,
        use_grouped_topk=c.num_expert_group > 1,
        num_expert_group=c.num_expert_group,
        topk_group=c.topk_group,
        num_nextn_predict_layers=0,
    )
    text.update({key: getattr(c, key) for key in EXTENSION_KEYS})
    if quantization_config_for(c.expert_format) is not None:
        text["quantization_config"] = quantization_config_for(c.expert_format)
    text.update({key: getattr(c, key) for key in TOKEN_KEYS if getattr(c, key, None) is not None})
    return text
