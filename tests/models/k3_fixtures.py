"""The test's own K3-layout writer and its fixtures (tests/models/test_k3_format.py): a tiny checkpoint in K3's
published layout (names and shapes from docs/architecture.md 2.3 / 7, per-expert tensors, padded A_log,
``[C, 1, 4]`` convs), written without the package's K3 code, so that loading it checks the package against it."""

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moe_plugin

A_LOG_STORED = 128  # K3 pads A_log to 128 entries


def tiny(attn_res=True, **overrides):
    return moe_plugin.preset_config("tiny", attn_res=attn_res, use_dsa_indexer=False, **overrides)


def k3_text_config(attn_res=True, num_nextn_predict_layers=0):
    """K3's config.json keys for the tiny preset, written by hand."""
    cfg = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 384,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "gate_rank": 16,
            "chunk_size": 32,
        },
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": False,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": num_nextn_predict_layers,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
    }
    if attn_res:
        cfg["attn_res_block_size"] = 2
    return cfg


def k3_text_shapes(k3, layers=None):
    """K3 tensor names and shapes of a text config (docs/architecture.md 7), independent of the package."""
    d, v = k3["hidden_size"], k3["vocab_size"]
    lin = k3["linear_attn_config"]
    h, k = lin["num_heads"], lin["head_dim"]
    hk, rank = h * k, lin.get("gate_rank", k)
    mh, qr, kvr = k3["num_attention_heads"], k3["q_lora_rank"], k3["kv_lora_rank"]
    nope, rope, vd = k3["qk_nope_head_dim"], k3["qk_rope_head_dim"], k3["v_head_dim"]
    e, f, lat = k3["num_experts"], k3["moe_intermediate_size"], k3["routed_expert_hidden_size"]
    shared = k3["num_shared_experts"] * f
    attn_res = k3.get("attn_res_block_size") is not None
    shapes = {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "model.norm.weight": (d,)}
    if attn_res:
        shapes.update({"model.output_attn_res_proj.weight": (1, d), "model.output_attn_res_norm.weight": (d,)})
    for i in layers if layers is not None else range(k3["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        if attn_res:
            for point in ("self_attention_res", "mlp_res"):
                shapes.update({p + f"{point}_proj.weight": (1, d), p + f"{point}_norm.weight": (d,)})
        a = p + "self_attn."
        if i + 1 in lin["full_attn_layers"]:
            shapes.update(
                {
                    a + "q_a_proj.weight": (qr, d),
                    a + "q_a_layernorm.weight": (qr,),
                    a + "q_b_proj.weight": (mh * (nope + rope), qr),
                    a + "kv_a_proj_with_mqa.weight": (kvr + rope, d),
                    a + "kv_a_layernorm.weight": (kvr,),
                    a + "kv_b_proj.weight": (mh * (nope + vd), kvr),
                    a + "g_proj.weight": (mh * vd, d),
                    a + "o_proj.weight": (d, mh * vd),
                }
            )
        else:
            for name in ("q", "k", "v"):
                shapes.update({a + f"{name}_proj.weight": (hk, d), a + f"{name}_conv1d.weight": (hk, 1, 4)})
            shapes.update(
                {
                    a + "f_a_proj.weight": (rank, d),
                    a + "f_b_proj.weight": (hk, rank),
                    a + "b_proj.weight": (h, d),
                    a + "g_proj.weight": (hk, d),
                    a + "A_log": (A_LOG_STORED,),
                    a + "dt_bias": (hk,),
                    a + "o_norm.weight": (k,),
                    a + "o_proj.weight": (d, hk),
                }
            )
        if i < k3["first_k_dense_replace"]:
            i_d = k3["intermediate_size"]
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (i_d, d),
                    p + "mlp.up_proj.weight": (i_d, d),
                    p + "mlp.down_proj.weight": (d, i_d),
                }
            )
            continue
        m = p + "block_sparse_moe."
        shapes.update(
            {
                m + "gate.weight": (e, d),
                m + "gate.e_score_correction_bias": (e,),
                m + "routed_expert_down_proj.weight": (lat, d),
                m + "routed_expert_norm.weight": (lat,),
                m + "routed_expert_up_proj.weight": (d, lat),
                m + "shared_experts.gate_proj.weight": (shared, d),
                m + "shared_experts.up_proj.weight": (shared, d),
                m + "shared_experts.down_proj.weight": (d, shared),
            }
        )
        for j in range(e):
            shapes.update(
                {
                    m + f"experts.{j}.w1.weight": (f, lat),
                    m + f"experts.{j}.w3.weight": (f, lat),
                    m + f"experts.{j}.w2.weight": (lat, f),
                }
            )
    return shapes


def random_tensors(shapes, num_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * 0.1
        if name.endswith(".A_log"):
            t = torch.zeros(shape)  # K3's padding entries are zero; only the first num_heads are real
            t[:num_heads] = torch.rand(num_heads, generator=gen) * 2
        elif name.endswith(("norm.weight", "layernorm.weight")):
            t = 1.0 + t
        out[name] = t
    return out


def write_k3(path, config, tensors, per_shard=60):
    """Writes config.json, shards of ``per_shard`` tensors and the index, as the published layout does."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    names = sorted(tensors)
    chunks = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    weight_map = {}
    for n, chunk in enumerate(chunks, 1):
        file = f"model-{n:05d}-of-{len(chunks):05d}.safetensors"
        save_file({name: tensors[name].contiguous() for name in chunk}, os.path.join(path, file))
        weight_map.update({name: file for name in chunk})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def direct_state_dict(tensors, num_heads, prefix=""):
    """The model's state dict built by hand: experts stacked, A_log unpadded, everything else as stored."""
    out, experts = {}, {}
    for name, t in tensors.items():
        rel = name[len("language_model.") :] if name.startswith("language_model.") else name
        target = name if rel == name and name.startswith(("vision_tower.", "mm_projector.")) else prefix + rel
        parts = target.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            key = ".".join(parts[: at + 1] + [parts[at + 2]])
            experts.setdefault(key, {})[int(parts[at + 1])] = t
        elif target.endswith(".A_log"):
            out[target] = t.reshape(-1)[:num_heads].clone()
        else:
            out[target] = t
    for key, per_expert in experts.items():
        out[key] = torch.stack([per_expert[j] for j in range(len(per_expert))])
    return out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def read_dir(path):
    tensors = {}
    for file in os.listdir(path):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors
