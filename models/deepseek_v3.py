"""DeepSeek-V3 on the model interface: ``MODEL = functitan.model.Model(...)`` at the bottom.

A pre-norm decoder (RMSNorm, SwiGLU) with two parts of its own:

- multi-head latent attention (MLA). Queries come through a low-rank latent (``wq_a``, RMSNorm ``q_norm``,
  ``wq_b``; ``q_lora_rank=None``: one ``wq``); keys and values through one shared latent: ``wkv_a`` projects a
  token to ``kv_lora_rank`` latent dims plus ``qk_rope_head_dim`` dims of a rotary key that every head shares;
  the latent is RMS-normalised (``kv_norm``) and ``wkv_b`` expands it into each head's non-rotary key
  (``qk_nope_head_dim``) and value (``v_head_dim``). A head's query is ``qk_nope_head_dim`` plain dims and
  ``qk_rope_head_dim`` rotary ones; the softmax scale is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
  RoPE follows transformers: with ``rope_interleave`` (the published default) the rotary dims are pairs
  ``(2j, 2j + 1)``, rotated by frequency ``j`` and laid out de-interleaved, as ``apply_rotary_pos_emb_interleave``
  does. The values are zero-padded to the query/key width for ``layout.attention`` (every attention path, the
  ring of context parallelism included, takes one head width) and the padding is cut from the output;
- mixture of experts in every layer from ``first_k_dense`` on (the first ones are dense MLPs of ``ffn_dim``),
  through ``layout.moe`` (``functitan.moe``): a sigmoid router over ``experts``, group-limited (the experts in
  ``n_group`` groups, a token's ``top_k`` chosen from its ``topk_group`` best groups), the choice shifted by the
  per-expert balancing bias ``moe.bias`` (HF's ``e_score_correction_bias``: it moves the choice, not the
  weights), the chosen scores renormalised (``norm_topk``) and scaled by ``routed_scale``; plus
  ``n_shared_experts`` shared experts, one SwiGLU of ``moe_ffn_dim * n_shared_experts`` every token goes
  through. The bias is loaded, saved and used for routing, and after each step the trainer moves it by
  ``optimizer.moe_bias_rate`` toward balance (arXiv 2408.15664; ``functitan.moe.LoadBalance``), not by the
  optimizer.

Not implemented: multi-token prediction (the published checkpoint's layer 61 is ignored on import; counts leave
it out, as transformers does), YaRN RoPE scaling and its softmax ``mscale`` (``config_from_hf`` refuses
``rope_type="yarn"``, so the published 128K-context config.json needs ``rope_parameters`` set to default RoPE to
load; the flavors here are the 4K pretraining shape), and FP8 weights. Every layout comes from the rules table:
FSDP, HSDP, context, expert and tensor parallelism (heads split over tp; the latents and the rotary key that all
heads share stay whole on every tp rank: ``layout.whole_over_tp`` gathers the key along the sequence under SP).

Parameters follow Hugging Face ``DeepseekV3ForCausalLM`` (weights ``(out, in)``)::

    embed.weight                         model.embed_tokens.weight
    layers.{i}.attn_norm.weight          model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.wq                   model.layers.{i}.self_attn.q_proj.weight          (q_lora_rank None)
    layers.{i}.attn.wq_a                 model.layers.{i}.self_attn.q_a_proj.weight
    layers.{i}.attn.q_norm.weight        model.layers.{i}.self_attn.q_a_layernorm.weight
    layers.{i}.attn.wq_b                 model.layers.{i}.self_attn.q_b_proj.weight
    layers.{i}.attn.wkv_a                model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight
    layers.{i}.attn.kv_norm.weight       model.layers.{i}.self_attn.kv_a_layernorm.weight
    layers.{i}.attn.wkv_b                model.layers.{i}.self_attn.kv_b_proj.weight
    layers.{i}.attn.wo                   model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.mlp_norm.weight           model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{w_gate,w_up,w_down}  model.layers.{i}.mlp.{gate,up,down}_proj.weight   (i < first_k_dense)
    layers.{i}.moe.router.weight         model.layers.{i}.mlp.gate.weight
    layers.{i}.moe.bias                  model.layers.{i}.mlp.gate.e_score_correction_bias
    layers.{i}.moe.experts.w_gate[j]     model.layers.{i}.mlp.experts.{j}.gate_proj.weight   (w_up, w_down alike)
    layers.{i}.moe.shared.w_gate         model.layers.{i}.mlp.shared_experts.gate_proj.weight (w_up, w_down alike)
    norm.weight                          model.norm.weight
    output.weight                        lm_head.weight

Logical names: the latents are ``q_lora`` and ``kv_lora`` (FSDP shards them as it shards ``embed``: the up
projections ``wq_b`` and ``wkv_b`` have no ``embed`` dim), ``wkv_a``'s rows (latent and rotary key) ``kv_a``.

References: DeepSeek-V3 technical report (arXiv 2412.19437), §2.1; DeepSeek-V2 (arXiv 2405.04434) for MLA;
auxiliary-loss-free balancing (arXiv 2408.15664).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from functitan import model as M
from functitan import rope
from functitan.model import HFMap, Param, TensorKey, normal, ones, transformers_major
from functitan.moe import Router, expert_params
from functitan.sharding import Layout
from models import qwen3
from models.llama import mlp, rms_norm

__all__ = ["DeepseekV3Config", "CONFIGS", "params", "active_params", "flops_per_token", "MODEL"]


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config:
    vocab_size: int = 129280
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    q_lora_rank: int | None = 1536  # None: queries by one projection (wq)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    ffn_dim: int = 18432  # the dense layers' MLP width
    moe_ffn_dim: int = 2048  # each routed (and shared) expert's width
    experts: int = 256
    top_k: int = 8
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    norm_topk: bool = True
    routed_scale: float = 2.5
    first_k_dense: int = 3  # layers 0 .. first_k_dense - 1 are dense (HF's first_k_dense_replace)
    balance: float = 0.0  # the sequence-wise balance loss's coefficient (DeepSeek-V3 uses 1e-4)
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        dims = "vocab_size dim n_layers n_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim ffn_dim"
        for key in (*dims.split(), "moe_ffn_dim", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"model.q_lora_rank={self.q_lora_rank} must be positive, or None for one q projection")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if not 0 <= self.first_k_dense <= self.n_layers or self.n_shared_experts < 0:
            raise ValueError(
                f"model.first_k_dense={self.first_k_dense} must be in 0..n_layers ({self.n_layers}) and "
                f"model.n_shared_experts={self.n_shared_experts} >= 0"
            )
        self.router  # noqa: B018 - checks top_k, n_group and topk_group against experts

    @property
    def router(self) -> Router:
        return Router(
            experts=self.experts,
            top_k=self.top_k,
            score="sigmoid",
            norm_topk=self.norm_topk,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scale=self.routed_scale,
            balance=self.balance,
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense


CONFIGS: dict[str, DeepseekV3Config] = {
    # tiny: trains in seconds on a CPU (the trainer sets vocab_size from the tokenizer); 3 layers, the first dense,
    # 8 experts in 4 groups (2 groups kept, 2 experts per token), a shared expert, both latents, v_head_dim < qk
    "debug": DeepseekV3Config(
        vocab_size=258,
        dim=64,
        n_layers=3,
        n_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        ffn_dim=128,
        moe_ffn_dim=32,
        experts=8,
        top_k=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scale=2.5,
        first_k_dense=1,
        max_seq_len=1024,
        balance=1e-2,
    ),
    # torchtitan's "16B" (DeepSeek-V2-Lite's shape): no q latent, 64 experts of 1408 (6 per token), 2 shared, one
    # dense layer. torchtitan routes it with a softmax; here it keeps DeepSeek-V3's sigmoid router (no groups,
    # renormalised, scale 1), so that it is a DeepseekV3ForCausalLM; the parameter count is the same.
    "16b": DeepseekV3Config(
        vocab_size=102400,
        dim=2048,
        n_layers=27,
        n_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        ffn_dim=10944,
        moe_ffn_dim=1408,
        experts=64,
        top_k=6,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        routed_scale=1.0,
        first_k_dense=1,
    ),
    # the published DeepSeek-V3 (deepseek-ai/DeepSeek-V3) without its multi-token-prediction layer: the defaults
    "671b": DeepseekV3Config(),
}


# ----------------------------------------------------------------------------------------------- params


def params(cfg: DeepseekV3Config) -> dict[str, Any]:
    """Every parameter, declared once: shape, logical names (what the rules shard) and initializer."""
    d, h, w = cfg.dim, cfg.n_heads, normal(cfg.init_std)

    def attn() -> dict[str, Any]:
        q: dict[str, Any]
        if cfg.q_lora_rank is None:
            q = {"wq": Param((h * cfg.qk_head_dim, d), ("heads", "embed"), w)}
        else:
            r = cfg.q_lora_rank
            q = {
                "wq_a": Param((r, d), ("q_lora", "embed"), w),
                "q_norm": {"weight": Param((r,), ("q_lora",), ones())},
                "wq_b": Param((h * cfg.qk_head_dim, r), ("heads", "q_lora"), w),
            }
        kv = cfg.kv_lora_rank
        return {
            **q,
            "wkv_a": Param((kv + cfg.qk_rope_head_dim, d), ("kv_a", "embed"), w),
            "kv_norm": {"weight": Param((kv,), ("kv_lora",), ones())},
            "wkv_b": Param((h * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv), ("heads", "kv_lora"), w),
            "wo": Param((d, h * cfg.v_head_dim), ("embed", "heads"), w),
        }

    def layer(i: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "attn_norm": {"weight": Param((d,), ("embed",), ones())},
            "attn": attn(),
            "mlp_norm": {"weight": Param((d,), ("embed",), ones())},
        }
        if cfg.is_moe(i):
            shared = cfg.moe_ffn_dim * cfg.n_shared_experts
            moe = expert_params(dim=d, ffn=cfg.moe_ffn_dim, router=cfg.router, init=w, shared_ffn=shared, bias=True)
            out["moe"] = moe
        else:
            f = cfg.ffn_dim
            out["mlp"] = {
                "w_gate": Param((f, d), ("mlp", "embed"), w),
                "w_up": Param((f, d), ("mlp", "embed"), w),
                "w_down": Param((d, f), ("embed", "mlp"), w),
            }
        return out

    tree: dict[str, Any] = {
        "embed": {"weight": Param((cfg.vocab_size, d), ("vocab", "embed"), w)},
        "layers": [layer(i) for i in range(cfg.n_layers)],
        "norm": {"weight": Param((d,), ("embed",), ones())},
    }
    if not cfg.tie_embeddings:
        tree["output"] = {"weight": Param((cfg.vocab_size, d), ("vocab", "embed"), w)}
    return tree


def active_params(cfg: DeepseekV3Config) -> int:
    """Parameters a token goes through: the whole model less the routed experts it does not choose (the
    shared experts, dense layers, attention and both tables are in)."""
    per_expert = 3 * cfg.dim * cfg.moe_ffn_dim
    idle = (cfg.experts - cfg.top_k) * per_expert * sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    return M.count(params(cfg)) - idle


def flops_per_token(cfg: DeepseekV3Config, seq_len: int) -> float:
    """Training FLOPs per token (PaLM's formula) over the *active* parameters (an untied token table is a lookup,
    not a matmul), and attention with its two widths: ``Q K^T`` over ``qk_head_dim`` and ``A V`` over
    ``v_head_dim``, each ``2 * heads * width * seq`` forward, times 3 with backward (causal not halved)."""
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    attention = 6 * cfg.n_layers * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len
    return float(6 * (active_params(cfg) - table) + attention)


def check_layout(
    cfg: DeepseekV3Config, *, tp: int = 1, seq_len: int | None = None, sequence_parallel: bool = False
) -> None:
    """Fail before launch when a tensor-parallel layout cannot split this model: tp splits the heads, the dense
    MLP and the shared experts' width evenly (the latents and the rotary key stay whole on every tp rank)."""
    widths = {"n_heads": cfg.n_heads, "ffn_dim": cfg.ffn_dim}
    if cfg.n_shared_experts:
        widths["moe_ffn_dim * n_shared_experts"] = cfg.moe_ffn_dim * cfg.n_shared_experts
    problems = [f"model.{k}={v}" for k, v in widths.items() if v % tp]
    if problems:
        ok = [d for d in range(1, tp + 1) if all(v % d == 0 for v in widths.values())]
        raise ValueError(
            f"parallelism.tp={tp} does not divide {', '.join(problems)}; tensor parallelism splits them evenly. "
            f"A tp that works for this model: {ok[-1]}"
        )
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(
            f"sequence parallelism with parallelism.tp={tp} needs training.seq_len divisible by {tp}, got {seq_len}; "
            f"use seq_len={seq_len - seq_len % tp or tp} or set parallelism.sequence_parallel=false"
        )


# ----------------------------------------------------------------------------------------------- compute


def latent_norm(x: Tensor, weight: Tensor, name: str, layout: Layout) -> Tensor:
    # x: (batch, seq, latent); RMSNorm in fp32 with eps 1e-6, as transformers' q_a_layernorm / kv_a_layernorm
    # (built without the config's rms_norm_eps)
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return layout.einsum(f"batch seq {name}, {name} -> batch seq {name}", xn, weight)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """RoPE on ``x (batch, heads, seq, rope_dim)``; ``interleave``: pairs ``(2j, 2j + 1)``, laid out as
    transformers' ``apply_rotary_pos_emb_interleave`` returns them (the evens' rotations, then the odds')."""
    if interleave:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return rope.apply(x, cos, sin)


def attention(p: dict[str, Any], x: Tensor, cfg: DeepseekV3Config, layout: Layout) -> Tensor:
    # x: (batch, seq, embed), the residual layout
    nope, rdim, vdim, qk = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
    if "wq" in p:
        q = layout.einsum("batch seq embed, heads embed -> batch seq heads", x, p["wq"])
    else:
        q_latent = layout.einsum("batch seq embed, q_lora embed -> batch seq q_lora", x, p["wq_a"])
        q_latent = latent_norm(q_latent, p["q_norm"]["weight"], "q_lora", layout)
        q = layout.einsum("batch seq q_lora, heads q_lora -> batch seq heads", q_latent, p["wq_b"])
    kv_a = layout.einsum("batch seq embed, kv_a embed -> batch seq kv_a", x, p["wkv_a"])
    kv_latent, k_rope = kv_a.split([cfg.kv_lora_rank, rdim], dim=-1)
    k_rope = layout.whole_over_tp(k_rope, "batch seq kv_a")  # every tp rank's heads share it
    kv_latent = latent_norm(kv_latent, p["kv_norm"]["weight"], "kv_lora", layout)
    kv = layout.einsum("batch seq kv_lora, heads kv_lora -> batch seq heads", kv_latent, p["wkv_b"])

    b, s = q.shape[:2]
    q_nope, q_rope = q.view(b, s, -1, qk).transpose(1, 2).split([nope, rdim], dim=-1)  # (batch, heads, seq, .)
    k_nope, v = kv.view(b, s, -1, nope + vdim).transpose(1, 2).split([nope, vdim], dim=-1)
    heads = q_nope.shape[1]
    cos, sin = layout.rotary(rdim, cfg.rope_theta, s, device=q.device, dtype=q.dtype)  # (seq, rope_dim)
    q_rope = rotate(q_rope, cos, sin, cfg.rope_interleave)
    k_rope = rotate(k_rope.unsqueeze(1), cos, sin, cfg.rope_interleave)  # (batch, 1, seq, rope_dim): one for all
    q = torch.cat((q_nope, q_rope), dim=-1)
    k = torch.cat((k_nope, k_rope.expand(-1, heads, -1, -1)), dim=-1)
    if vdim < qk:  # one head width for every attention path; the zero columns give zero outputs, cut below
        v = F.pad(v, (0, qk - vdim))
    o = layout.attention(q, k, v, scale=qk**-0.5)[..., :vdim]  # causal
    o = o.transpose(1, 2).reshape(b, s, -1)  # (batch, seq, local heads * v_head_dim)
    return layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["wo"])


def block(p: dict[str, Any], x: Tensor, cfg: DeepseekV3Config, layout: Layout) -> Any:
    """One pre-norm block on compute params: ``x``, or ``(x, aux)`` for a MoE block."""
    x = x + attention(p["attn"], rms_norm(x, p["attn_norm"]["weight"], cfg.norm_eps, layout), cfg, layout)
    h = rms_norm(x, p["mlp_norm"]["weight"], cfg.norm_eps, layout)
    if "moe" not in p:
        return x + mlp(p["mlp"], h, layout)
    out, aux = layout.moe(h, p["moe"], cfg.router)  # routed (bias in the choice) + shared experts
    return x + out, aux


# ----------------------------------------------------------------------------------------------- Hugging Face

_HF_ATTN = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}
_HF_MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))


def hf_tensors(cfg: DeepseekV3Config) -> dict[str, TensorKey]:
    """``{our dotted name: TensorKey}``: a renaming (the module docstring's table), routed experts one key each."""
    out = {
        "embed.weight": TensorKey(key="model.embed_tokens.weight"),
        "norm.weight": TensorKey(key="model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = TensorKey(key="lm_head.weight")
    q = ("wq",) if cfg.q_lora_rank is None else ("wq_a", "q_norm", "wq_b")
    attn = (*q, "wkv_a", "kv_norm", "wkv_b", "wo")
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        out[f"{ours}.attn_norm.weight"] = TensorKey(key=f"{hf}.input_layernorm.weight")
        out[f"{ours}.mlp_norm.weight"] = TensorKey(key=f"{hf}.post_attention_layernorm.weight")
        for k in attn:
            leaf = ".weight" if k.endswith("norm") else ""
            out[f"{ours}.attn.{k}{leaf}"] = TensorKey(key=f"{hf}.self_attn.{_HF_ATTN[k]}.weight")
        if not cfg.is_moe(i):
            out.update({f"{ours}.mlp.{a}": TensorKey(key=f"{hf}.mlp.{b}.weight") for a, b in _HF_MLP})
            continue
        out[f"{ours}.moe.router.weight"] = TensorKey(key=f"{hf}.mlp.gate.weight")
        out[f"{ours}.moe.bias"] = TensorKey(key=f"{hf}.mlp.gate.e_score_correction_bias")
        for a, b in _HF_MLP:
            out[f"{ours}.moe.experts.{a}"] = TensorKey(
                key=f"{hf}.mlp.experts.*.{b}.weight",
                stacked=tuple(f"{hf}.mlp.experts.{j}.{b}.weight" for j in range(cfg.experts)),
            )
            if cfg.n_shared_experts:
                out[f"{ours}.moe.shared.{a}"] = TensorKey(key=f"{hf}.mlp.shared_experts.{b}.weight")
    return out


def config_to_hf(cfg: DeepseekV3Config, *, transformers_version: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``DeepseekV3ForCausalLM`` (5.x: ``rope_parameters``; 4.x: ``rope_theta``), without
    multi-token prediction (``num_nextn_predict_layers=0``)."""
    d: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.experts,
        "num_experts_per_tok": cfg.top_k,
        "n_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk,
        "routed_scaling_factor": cfg.routed_scale,
        "first_k_dense_replace": cfg.first_k_dense,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.norm_eps,
        "rope_interleave": cfg.rope_interleave,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
    }
    if transformers_major(transformers_version) >= 5:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    else:
        d["rope_theta"], d["rope_scaling"] = float(cfg.rope_theta), None
    return d


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# key -> the only value functitan's DeepSeek-V3 implements
_FIXED = {"hidden_act": "silu", "attention_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def config_from_hf(d: Mapping[str, Any]) -> DeepseekV3Config:
    """The DeepseekV3Config of a ``DeepseekV3ForCausalLM`` ``config.json``; settings the model does not implement
    (YaRN or other RoPE scaling, attention biases, another scoring function) raise ValueError naming the key.
    Missing keys take transformers' defaults. ``num_nextn_predict_layers`` is ignored (no multi-token prediction)."""
    if d.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise ValueError(
            f"config.json model_type={d['model_type']!r} is not supported; only 'deepseek_v3' "
            "(DeepseekV3ForCausalLM) is"
        )
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a DeepseekV3ForCausalLM config needs all of {list(_REQUIRED)}")
    for key, value in _FIXED.items():
        if d.get(key, value) != value:
            raise ValueError(
                f"config.json {key}={d[key]!r} is not supported; functitan's DeepSeek-V3 implements {key}={value!r}"
            )
    n_heads = int(d["num_attention_heads"])  # num_key_value_heads is not read: MLA expands the latent per head
    where = "rope_parameters" if d.get("rope_parameters") is not None else "rope_scaling"
    rope_hf = d.get(where) or {}
    rope_type = rope_hf.get("rope_type", rope_hf.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"config.json {where}.rope_type={rope_type!r} is not supported; functitan's DeepSeek-V3 implements "
            "'default' RoPE (no YaRN scaling or mscale)"
        )
    q_lora = d.get("q_lora_rank", 1536)
    return DeepseekV3Config(
        vocab_size=int(d["vocab_size"]),
        dim=int(d["hidden_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(d.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
        v_head_dim=int(d.get("v_head_dim") or 128),
        ffn_dim=int(d["intermediate_size"]),
        moe_ffn_dim=int(d.get("moe_intermediate_size", 2048)),
        experts=int(d.get("n_routed_experts", 256)),
        top_k=int(d.get("num_experts_per_tok") or 8),
        n_shared_experts=int(d.get("n_shared_experts", 1)),
        n_group=int(d.get("n_group") or 8),
        topk_group=int(d.get("topk_group") or 4),
        norm_topk=bool(d.get("norm_topk_prob", True)),
        routed_scale=float(d.get("routed_scaling_factor", 2.5)),
        first_k_dense=int(d.get("first_k_dense_replace", 3)),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_hf.get("rope_theta", d.get("rope_theta", 10000.0))),
        rope_interleave=bool(d.get("rope_interleave", True)),
        max_seq_len=int(d.get("max_position_embeddings") or 4096),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=float(d.get("initializer_range", 0.02)),
    )


HF = HFMap(
    architecture="DeepseekV3ForCausalLM",
    config_to_hf=config_to_hf,
    config_from_hf=config_from_hf,
    tensors=hf_tensors,
    tied=qwen3.HF.tied,  # the head tied to the token table, as Qwen3 names it
    ignored=(r"model\.layers\.61\..*",),  # the published checkpoint's multi-token-prediction layer, as transformers
)


MODEL = M.Model(
    name="deepseek_v3",
    configs=CONFIGS,
    params=params,
    pieces=dataclasses.replace(  # Qwen3's embed and head (and their keys for pipeline stages)
        qwen3.PIECES, block=block, attention_dim=lambda cfg: cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) // 2
    ),
    flops_per_token=flops_per_token,
    check_layout=check_layout,
    hf=HF,
)
