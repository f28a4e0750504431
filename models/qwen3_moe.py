"""Qwen3-MoE on the model interface: ``MODEL = functitan.model.Model(...)`` at the bottom.

Qwen3's block (``models.qwen3``: QK-norm, grouped-query attention, RoPE) with the MLP of every
``decoder_sparse_step``-th layer (and none of ``mlp_only_layers``) replaced by a mixture of experts through
``layout.moe`` (``functitan.moe``): a softmax router over ``experts``, the ``top_k`` best per token (renormalised
with ``norm_topk``), each expert a SwiGLU of width ``moe_ffn_dim``; no shared expert. A MoE block returns its aux
(each expert's share of the tokens; with ``balance > 0`` the sequence-wise balance loss) beside ``x``, and the
composed loss adds the balance term to the cross-entropy.

Parameters follow Hugging Face ``Qwen3MoeForCausalLM``; routed experts are one tensor per matrix with a leading
expert dim, which a checkpoint stores one expert at a time::

    layers.{i}.moe.router.weight          model.layers.{i}.mlp.gate.weight
    layers.{i}.moe.experts.w_gate[j]      model.layers.{i}.mlp.experts.{j}.gate_proj.weight
    layers.{i}.moe.experts.w_up[j]        model.layers.{i}.mlp.experts.{j}.up_proj.weight
    layers.{i}.moe.experts.w_down[j]      model.layers.{i}.mlp.experts.{j}.down_proj.weight
    (dense layers, attention, norms, embedding and head as models.qwen3)

``router_aux_loss_coef`` of a Hugging Face config is the coefficient of transformers' Switch-style loss over the
whole batch, which no split of the batch computes exactly; functitan's term is DeepSeek-V3's sequence-wise loss
(``balance``), exact under every layout, so the two are not converted into each other.

References: Qwen3 technical report (arXiv 2505.09388); DeepSeek-V3 §2.1.2 (arXiv 2412.19437).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from functitan import model as M
from functitan.metrics import transformer_flops_per_token
from functitan.model import HFMap, TensorKey, normal
from functitan.moe import Router, expert_params
from functitan.sharding import Layout
from models import qwen3
from models.llama import mlp, rms_norm

__all__ = ["Qwen3MoeConfig", "CONFIGS", "params", "flops_per_token", "MODEL"]


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig:
    vocab_size: int = 151936
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    ffn_dim: int = 6144  # the dense layers' MLP width (mlp_only_layers)
    moe_ffn_dim: int = 768  # each expert's width
    experts: int = 128
    top_k: int = 8
    norm_topk: bool = True
    decoder_sparse_step: int = 1  # every n-th layer is MoE
    mlp_only_layers: tuple[int, ...] = ()
    balance: float = 0.0  # the sequence-wise balance loss's coefficient (DeepSeek-V3 uses 1e-4)
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("moe_ffn_dim", "experts", "top_k", "decoder_sparse_step"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        qwen3.Qwen3Config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(qwen3.Qwen3Config)})
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"model.mlp_only_layers={list(self.mlp_only_layers)}: {bad} not in 0..{self.n_layers - 1}")
        self.router  # noqa: B018 - checks top_k against experts

    @property
    def router(self) -> Router:
        return Router(experts=self.experts, top_k=self.top_k, norm_topk=self.norm_topk, balance=self.balance)

    def is_moe(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


_PUBLISHED: dict[str, Any] = dict(
    vocab_size=151936, head_dim=128, n_kv_heads=4, experts=128, top_k=8, rope_theta=1_000_000.0, max_seq_len=40960
)

CONFIGS: dict[str, Qwen3MoeConfig] = {
    # tiny: trains in seconds on a CPU (the trainer sets vocab_size from the tokenizer); 8 experts, 2 per token
    "debug": Qwen3MoeConfig(
        vocab_size=258,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        moe_ffn_dim=32,
        experts=8,
        top_k=2,
        max_seq_len=1024,
        balance=1e-2,
    ),
    # the published checkpoints (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B)
    "30b_a3b": Qwen3MoeConfig(**_PUBLISHED, dim=2048, n_layers=48, n_heads=32, ffn_dim=6144, moe_ffn_dim=768),
    "235b_a22b": Qwen3MoeConfig(**_PUBLISHED, dim=4096, n_layers=94, n_heads=64, ffn_dim=12288, moe_ffn_dim=1536),
}


# ----------------------------------------------------------------------------------------------- params


def params(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    """Every parameter, declared once: Qwen3's tree with a ``moe`` in place of ``mlp`` in MoE layers."""
    tree = qwen3.params(cfg)  # type: ignore[arg-type]  # the fields qwen3.params reads are Qwen3Config's
    w = normal(cfg.init_std)
    for i, layer in enumerate(tree["layers"]):
        if cfg.is_moe(i):
            del layer["mlp"]
            layer["moe"] = expert_params(dim=cfg.dim, ffn=cfg.moe_ffn_dim, router=cfg.router, init=w)
    return tree


def active_params(cfg: Qwen3MoeConfig) -> int:
    """Parameters a token goes through: the whole model less the routed experts it does not choose."""
    per_expert = 3 * cfg.dim * cfg.moe_ffn_dim
    idle = (cfg.experts - cfg.top_k) * per_expert * sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    return M.count(params(cfg)) - idle


def flops_per_token(cfg: Qwen3MoeConfig, seq_len: int) -> float:
    """Training FLOPs per token (PaLM's formula) over the *active* parameters: the top-k routed experts, not all
    of them; an untied token table is a lookup, not a matmul."""
    table = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return transformer_flops_per_token(
        n_params=active_params(cfg) - table,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        seq_len=seq_len,
    )


def check_layout(
    cfg: Qwen3MoeConfig, *, tp: int = 1, seq_len: int | None = None, sequence_parallel: bool = False
) -> None:
    """Qwen3's checks (heads, kv heads and the dense MLP width divide by tp); experts are not split by tp."""
    qwen3.check_layout(cfg, tp=tp, seq_len=seq_len, sequence_parallel=sequence_parallel)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------- compute


def block(p: dict[str, Any], x: Tensor, cfg: Qwen3MoeConfig, layout: Layout) -> Any:
    """One pre-norm block on compute params: ``x``, or ``(x, aux)`` for a MoE block."""
    x = x + qwen3.attention(p["attn"], rms_norm(x, p["attn_norm"]["weight"], cfg.norm_eps, layout), cfg, layout)  # type: ignore[arg-type]
    h = rms_norm(x, p["mlp_norm"]["weight"], cfg.norm_eps, layout)
    if "moe" not in p:
        return x + mlp(p["mlp"], h, layout)
    out, aux = layout.moe(h, p["moe"], cfg.router)
    return x + out, aux


# ----------------------------------------------------------------------------------------------- Hugging Face


def hf_tensors(cfg: Qwen3MoeConfig) -> dict[str, TensorKey]:
    """``{our dotted name: TensorKey}``: Qwen3's names, and each MoE layer's router and stacked experts."""
    dense = qwen3.hf_tensors(cfg)  # type: ignore[arg-type]
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i in range(cfg.n_layers):
        hf = f"model.layers.{i}.mlp"
        if not cfg.is_moe(i):
            out.update({k: v for k, v in dense.items() if k.startswith(f"layers.{i}.mlp.")})
            continue
        out[f"layers.{i}.moe.router.weight"] = TensorKey(key=f"{hf}.gate.weight")
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[f"layers.{i}.moe.experts.{ours}"] = TensorKey(
                key=f"{hf}.experts.*.{theirs}.weight",
                stacked=tuple(f"{hf}.experts.{j}.{theirs}.weight" for j in range(cfg.experts)),
            )
    return out


def config_to_hf(cfg: Qwen3MoeConfig, *, transformers_version: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``Qwen3MoeForCausalLM``: Qwen3's keys and the MoE ones."""
    d = qwen3.config_to_hf(cfg, transformers_version=transformers_version)  # type: ignore[arg-type]
    d.update(
        model_type="qwen3_moe",
        moe_intermediate_size=cfg.moe_ffn_dim,
        num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )
    return d


def config_from_hf(d: Mapping[str, Any]) -> Qwen3MoeConfig:
    """The Qwen3MoeConfig of a ``Qwen3MoeForCausalLM`` ``config.json`` (Qwen3's checks, then the MoE keys)."""
    if d.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise ValueError(
            f"config.json model_type={d['model_type']!r} is not supported; only 'qwen3_moe' (Qwen3MoeForCausalLM) is"
        )
    d = {**d, "num_experts": d.get("num_experts", d.get("num_local_experts"))}  # transformers 5 writes the latter
    missing = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") if d.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a Qwen3MoeForCausalLM config needs them")
    dense = qwen3.config_from_hf({**d, "model_type": "qwen3"})
    return Qwen3MoeConfig(
        **{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)},
        moe_ffn_dim=int(d["moe_intermediate_size"]),
        experts=int(d["num_experts"]),
        top_k=int(d["num_experts_per_tok"]),
        norm_topk=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )


HF = HFMap(
    architecture="Qwen3MoeForCausalLM",
    config_to_hf=config_to_hf,
    config_from_hf=config_from_hf,
    tensors=hf_tensors,
    tied=qwen3.HF.tied,
)


MODEL = M.Model(
    name="qwen3_moe",
    configs=CONFIGS,
    params=params,
    pieces=dataclasses.replace(qwen3.PIECES, block=block),  # Qwen3's embed and head
    flops_per_token=flops_per_token,
    check_layout=check_layout,
    hf=HF,
)
