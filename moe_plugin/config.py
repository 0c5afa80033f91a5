"""Validated configuration dataclasses for every part of the model.

Each dataclass checks itself in ``__post_init__`` so that a config that cannot work fails when it is
built, with a ``ValueError`` that names the offending field and says what would fix it. Layers take
these dataclasses; the Hugging Face config (``moe_plugin.models``) and the megatron-core specs
(``moe_plugin.megatron``) translate to and from them, so the numbers live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

ACTIVATIONS = ("situ", "swiglu")
KDA_GATE_FORMS = ("k3", "kimi_linear")
LAYER_KINDS = ("kda", "mla")
# how the routed experts are stored: "dense" floating-point weights, or packed as published (docs/packed-experts.md)
EXPERT_FORMATS = ("dense", "mxfp4", "int4")
# the model_type a checkpoint's config.json names: this project's save_pretrained (MoEPluginConfig), K3's text
# model, and the multimodal wrapper this project writes (not confirmed against a published K3 multimodal
# config). Here, torch- and transformers-free, so the recipe reader and the weight planner tell the layouts apart.
HF_MODEL_TYPE = "moe_plugin"
K3_TEXT_MODEL_TYPE = "kimi_linear"
K3_VL_MODEL_TYPE = "kimi_k3"


def require(condition: bool, field_name: str, message: str) -> None:
    """Raise ``ValueError("<field_name>: <message>")`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(f"{field_name}: {message}")


def _positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(
            isinstance(value, int) and value > 0,
            f"{type(obj).__name__}.{name}",
            f"must be a positive integer, got {value!r}",
        )


@dataclass
class KDAConfig:
    """Kimi Delta Attention (docs/architecture.md 2.1)."""

    hidden_size: int
    num_heads: int
    head_dim: Optional[int] = None  # default hidden_size / num_heads
    conv_size: int = 4
    gate_form: str = "k3"  # "k3": lower_bound * sigmoid(...); "kimi_linear": -exp(A_log) * softplus(...)
    gate_lower_bound: float = -5.0
    gate_rank: Optional[int] = None  # rank of the decay-gate projection f_a/f_b; default head_dim
    chunk_size: int = 64
    norm_eps: float = 1e-5

    def __post_init__(self):
        _positive(self, "hidden_size", "num_heads")
        if self.head_dim is None:
            require(
                self.hidden_size % self.num_heads == 0,
                "KDAConfig.num_heads",
                f"must divide hidden_size ({self.hidden_size}) when head_dim is not given, got {self.num_heads}",
            )
            self.head_dim = self.hidden_size // self.num_heads
        if self.gate_rank is None:
            self.gate_rank = self.head_dim
        _positive(self, "head_dim", "conv_size", "gate_rank", "chunk_size")
        require(
            self.gate_form in KDA_GATE_FORMS,
            "KDAConfig.gate_form",
            f"must be one of {KDA_GATE_FORMS}, got {self.gate_form!r}",
        )
        require(
            self.gate_lower_bound < 0,
            "KDAConfig.gate_lower_bound",
            f"must be negative (a log decay), got {self.gate_lower_bound}",
        )

    @property
    def proj_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass
class MLAConfig:
    """Gated multi-head latent attention with the optional DSA lightning indexer (docs/architecture.md 2.2)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = True
    use_indexer: bool = True
    index_topk: int = 2048
    index_n_heads: int = 64
    index_head_dim: int = 128
    norm_eps: float = 1e-5

    def __post_init__(self):
        _positive(
            self,
            "hidden_size",
            "num_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "index_topk",
            "index_n_heads",
            "index_head_dim",
        )
        require(
            isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0,
            "MLAConfig.qk_rope_head_dim",
            f"must be a non-negative integer, got {self.qk_rope_head_dim!r}",
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class MoEConfig:
    """Stable Latent MoE (docs/architecture.md 3)."""

    hidden_size: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    latent_size: Optional[int] = None  # None: experts work on the full hidden (no latent projection)
    latent_norm: bool = True
    num_shared_experts: int = 1
    shared_intermediate_size: Optional[int] = None  # fused width of all shared experts; default n * expert width
    activation: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    bias_update_rate: float = 1e-3
    norm_eps: float = 1e-5
    expert_format: str = "dense"  # "mxfp4" / "int4": routed experts kept packed, dequantised on the fly

    def __post_init__(self):
        require(
            self.expert_format in EXPERT_FORMATS,
            "MoEConfig.expert_format",
            f"must be one of {EXPERT_FORMATS}, got {self.expert_format!r}",
        )
        _positive(self, "hidden_size", "num_experts", "top_k", "expert_intermediate_size", "num_groups", "topk_groups")
        if self.latent_size is not None:
            _positive(self, "latent_size")
        require(
            self.num_shared_experts >= 0, "MoEConfig.num_shared_experts", f"must be >= 0, got {self.num_shared_experts}"
        )
        if self.shared_intermediate_size is None:
            self.shared_intermediate_size = self.num_shared_experts * self.expert_intermediate_size
        require(
            self.top_k <= self.num_experts,
            "MoEConfig.top_k",
            f"must be <= num_experts ({self.num_experts}), got {self.top_k}",
        )
        require(
            self.activation in ACTIVATIONS,
            "MoEConfig.activation",
            f"must be one of {ACTIVATIONS}, got {self.activation!r}",
        )
        require(
            self.num_experts % self.num_groups == 0,
            "MoEConfig.num_groups",
            f"must divide num_experts ({self.num_experts}), got {self.num_groups}",
        )
        require(
            self.topk_groups <= self.num_groups,
            "MoEConfig.topk_groups",
            f"must be <= num_groups ({self.num_groups}), got {self.topk_groups}",
        )
        per_group = self.num_experts // self.num_groups
        require(
            self.top_k <= self.topk_groups * per_group,
            "MoEConfig.top_k",
            f"must be <= topk_groups * experts per group ({self.topk_groups * per_group}), got {self.top_k}",
        )

    @property
    def expert_dim(self) -> int:
        """Width of the tokens the routed experts see (the latent width, or the hidden size)."""
        return self.latent_size or self.hidden_size


# the vision towers this project builds: "vit", its own ViT (the shipped tiny image bases); "moonvit3d", Kimi
# K3's MoonViT-3D tower with its patch-merger projector "patchmergerv2", under the release's names
# (docs/multimodal.md 7)
VISION_KINDS = ("vit", "moonvit3d")


@dataclass
class VisionConfig:
    """A ViT over 14-pixel patches with a 2x2 merge and an MLP projector (docs/architecture.md 4).

    ``kind`` picks the tower: ``"vit"`` (this project's: biases, rotary pairs (i, i + D/2), patches in merged-block
    order) or ``"moonvit3d"`` (K3's MoonViT-3D: no biases, ``qkv_hidden_size`` wide attention, interleaved rotary
    pairs, patches in raster order, a fixed sin-cos time table of ``pos_emb_time`` frames, ``norm_eps`` None: the
    tower's norms take the eps of their input's dtype as the release's do; ``projector_eps`` is its projector norm's).
    """

    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4096
    patch_size: int = 14
    merge_size: int = 2
    num_channels: int = 3
    max_grid: int = 64  # learned 2-D position table side; interpolated to each image's grid
    out_hidden_size: int = 7168
    norm_eps: Optional[float] = 1e-5
    rope_theta: float = 10000.0  # base of the 2-D rotary frequencies inside the ViT's attention
    kind: str = "vit"
    qkv_hidden_size: Optional[int] = None  # width of q, k and v each (default hidden_size)
    pos_emb_time: int = 4  # frames the moonvit3d time table covers (an image is one frame)
    projector_eps: float = 1e-5  # the moonvit3d projector's post_norm

    def __post_init__(self):
        require(self.kind in VISION_KINDS, "VisionConfig.kind", f"must be one of {VISION_KINDS}, got {self.kind!r}")
        if self.qkv_hidden_size is None:
            self.qkv_hidden_size = self.hidden_size
        _positive(
            self,
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "patch_size",
            "merge_size",
            "num_channels",
            "max_grid",
            "out_hidden_size",
            "qkv_hidden_size",
            "pos_emb_time",
        )
        require(self.rope_theta > 0, "VisionConfig.rope_theta", f"must be positive, got {self.rope_theta}")
        require(
            self.norm_eps is None or self.norm_eps > 0,
            "VisionConfig.norm_eps",
            f"must be positive (or None: the input dtype's eps), got {self.norm_eps}",
        )
        require(
            self.norm_eps is not None or self.kind == "moonvit3d",
            "VisionConfig.norm_eps",
            "None (the dtype's eps) is the moonvit3d tower's; give the vit tower a number",
        )
        require(
            self.kind == "moonvit3d" or self.qkv_hidden_size == self.hidden_size,
            "VisionConfig.qkv_hidden_size",
            f"the vit tower attends at hidden_size ({self.hidden_size}), got {self.qkv_hidden_size}",
        )
        require(
            self.qkv_hidden_size % self.num_heads == 0,
            "VisionConfig.num_heads",
            f"must divide qkv_hidden_size ({self.qkv_hidden_size}), got {self.num_heads}",
        )
        require(
            (self.qkv_hidden_size // self.num_heads) % 4 == 0,
            "VisionConfig.num_heads",
            "head dim (qkv_hidden_size / num_heads) must be a multiple of 4 for 2-D rotary positions",
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``qkv_hidden_size / num_heads``."""
        return self.qkv_hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch, ``num_channels * patch_size**2`` (flattened as (C, ph, pw))."""
        return self.num_channels * self.patch_size**2

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token, ``merge_size**2 * hidden_size`` (the projector's input)."""
        return self.merge_size**2 * self.hidden_size


@dataclass
class ModelConfig:
    """The whole text model: embedding, a schedule of decoder layers, final norm and output layer."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    layer_types: Optional[List[str]] = None  # per layer "kda" or "mla"; default: every 4th layer is "mla"
    first_k_dense: int = 1
    dense_intermediate_size: int = 0
    attn_res: bool = False
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    vision: Optional[VisionConfig] = None
    image_token_id: Optional[int] = None

    def __post_init__(self):
        _positive(self, "vocab_size", "hidden_size", "num_layers", "attn_res_block_size")
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_layers)
        self.layer_types = list(self.layer_types)
        require(
            len(self.layer_types) == self.num_layers,
            "ModelConfig.layer_types",
            f"needs one entry per layer ({self.num_layers}), got {len(self.layer_types)}",
        )
        bad = sorted({t for t in self.layer_types if t not in LAYER_KINDS})
        require(not bad, "ModelConfig.layer_types", f"entries must be in {LAYER_KINDS}, got {bad}")
        require(
            0 <= self.first_k_dense <= self.num_layers,
            "ModelConfig.first_k_dense",
            f"must be in [0, num_layers={self.num_layers}], got {self.first_k_dense}",
        )
        if self.first_k_dense:
            _positive(self, "dense_intermediate_size")
        for part in ("kda", "mla", "moe"):
            sub = getattr(self, part)
            require(
                sub.hidden_size == self.hidden_size,
                f"ModelConfig.{part}.hidden_size",
                f"must equal hidden_size ({self.hidden_size}), got {sub.hidden_size}",
            )
        if self.vision is not None:
            require(
                self.vision.out_hidden_size == self.hidden_size,
                "ModelConfig.vision.out_hidden_size",
                f"must equal hidden_size ({self.hidden_size}), got {self.vision.out_hidden_size}",
            )
            require(
                self.image_token_id is not None and 0 <= self.image_token_id < self.vocab_size,
                "ModelConfig.image_token_id",
                f"must be a token id below vocab_size ({self.vocab_size}) when vision is set",
            )

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense


def default_layer_types(num_layers: int, every: int = 4) -> List[str]:
    """Three KDA layers to one MLA layer, with the last layer always full attention (as K3 does)."""
    types = ["mla" if (i + 1) % every == 0 else "kda" for i in range(num_layers)]
    types[-1] = "mla"
    return types
