"""The functional Llama of ``models/llama.py`` written as an ordinary ``nn.Module``: the baseline to compare with.

The math is the same op for op (fp32 RMSNorm with the weight applied after the cast back, RoPE with HF's
``rotate_half`` on dimension pairs ``(i, i + head_dim/2)``, GQA through SDPA with ``enable_gqa``, SwiGLU), so
with the same parameters both give the same logits. Module and attribute names follow torchtitan, so its
FSDP2 (``fully_shard`` per block) and tensor-parallel plans (``parallelize_module`` on
``layers[i].attention.wq`` ...) apply unchanged::

    functitan (models/llama.py)      this module (torchtitan names)
    embed.weight                     tok_embeddings.weight
    layers.{i}.attn_norm.weight      layers.{i}.attention_norm.weight
    layers.{i}.attn.{wq,wk,wv,wo}    layers.{i}.attention.{wq,wk,wv,wo}.weight
    layers.{i}.mlp_norm.weight       layers.{i}.ffn_norm.weight
    layers.{i}.mlp.w_gate            layers.{i}.feed_forward.w1.weight
    layers.{i}.mlp.w_down            layers.{i}.feed_forward.w2.weight
    layers.{i}.mlp.w_up              layers.{i}.feed_forward.w3.weight
    norm.weight                      norm.weight
    output.weight                    output.weight   (absent when embeddings are tied)

``from_functional(params, cfg)`` builds the module from a functitan param tree; ``to_functional(module)``
goes back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from functitan.model import Param, is_param
from functitan.tree import map_with_names
from models import llama
from models.llama import LlamaConfig

__all__ = [
    "Llama",
    "TransformerBlock",
    "Attention",
    "FeedForward",
    "RMSNorm",
    "module_name",
    "from_functional",
    "to_functional",
]


class RMSNorm(nn.Module):
    """Normalise in fp32 and cast back before the weight, as HF's ``LlamaRMSNorm`` does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, seq, dim)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape  # x: (batch, seq, dim); cos, sin: (seq, head_dim)
        # -1 heads: under tensor parallelism the projections hold this rank's heads only
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (batch, kv_heads, seq, head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (torchtitan's names: w1 gate, w3 up, w2 down)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama 3 as a module: ``forward(tokens (batch, seq)) -> logits (batch, seq, vocab)``.

    RoPE tables are non-persistent buffers computed once for ``max_seq_len`` (as torchtitan's ``freqs_cis``)
    with ``models.llama.rope_tables``, so both implementations rotate by the same numbers.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the RoPE buffers, e.g. after ``to_empty`` from the meta device."""
        if self.rope_cos.is_meta:
            return
        cos, sin = llama.rope_tables(
            self.cfg, self.cfg.max_seq_len, device=self.rope_cos.device, dtype=self.rope_cos.dtype
        )
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens: Tensor) -> Tensor:
        s = tokens.shape[1]  # tokens: (batch, seq)
        if s > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={self.cfg.max_seq_len}; shorten the batch")
        x = self.tok_embeddings(tokens)  # (batch, seq, dim)
        cos, sin = self.rope_cos[:s].to(x.dtype), self.rope_sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        return self.output(x) if self.output is not None else F.linear(x, self.tok_embeddings.weight)

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy in fp32 (``tokens``, ``targets``: (batch, seq))."""
        return F.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())


# ----------------------------------------------------------------------------------------------- conversion

_RENAMES = {
    "embed.weight": "tok_embeddings.weight",
    "attn_norm.weight": "attention_norm.weight",
    "attn.wq": "attention.wq.weight",
    "attn.wk": "attention.wk.weight",
    "attn.wv": "attention.wv.weight",
    "attn.wo": "attention.wo.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.w_gate": "feed_forward.w1.weight",
    "mlp.w_down": "feed_forward.w2.weight",
    "mlp.w_up": "feed_forward.w3.weight",
    "norm.weight": "norm.weight",
    "output.weight": "output.weight",
}


def module_name(name: str) -> str:
    """The module parameter name of a functitan param name: ``"layers.3.mlp.w_gate"`` -> ``"layers.3.feed_forward.w1.weight"``."""
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        if rest in _RENAMES:
            return f"layers.{i}.{_RENAMES[rest]}"
    elif name in _RENAMES:
        return _RENAMES[name]
    raise ValueError(
        f"{name!r} is not a Llama parameter name; expected one of the names in models/llama.py's docstring"
    )


def from_functional(params: Any, cfg: LlamaConfig, *, device: torch.device | str | None = None) -> Llama:
    """A ``Llama`` module holding copies of ``params`` (a ``models.llama`` tree), on their device and dtype.

    DTensor leaves are gathered with ``full_tensor()`` (a collective: call on every rank). The module is built
    on the meta device and materialised once, so nothing is initialised twice. Raises ValueError naming the
    first key path whose shape differs from ``cfg``'s (or that ``cfg`` does not have).
    """
    full: dict[str, Tensor] = {}

    def one(name: str, info: Param, p: Any) -> None:
        t = p.full_tensor() if isinstance(p, DTensor) else p
        if not isinstance(t, Tensor) or tuple(t.shape) != info.shape:
            found = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else f"a {type(t).__name__}"
            raise ValueError(
                f"from_functional: params[{name!r}] has {found} but the config gives {info.shape}; "
                f"pass the LlamaConfig the params were made with"
            )
        full[module_name(name)] = t.detach()

    map_with_names(one, llama.params(cfg), params, is_leaf=is_param, what=("the config's params", "params"))
    first = next(iter(full.values()))
    device = torch.device(device) if device is not None else first.device
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device=device)
    model.to(first.dtype)
    model.reset_rope()
    module_params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in full.items():
            module_params[name].copy_(t)
    return model


def to_functional(module: Llama) -> dict[str, Any]:
    """The ``models.llama`` param tree of ``module`` (detached copies; DTensor parameters stay DTensors)."""
    cfg = module.cfg
    module_params = dict(module.named_parameters(remove_duplicate=False))

    def one(name: str, info: Param) -> Tensor:
        return module_params[module_name(name)].detach().clone()

    return map_with_names(one, llama.params(cfg), is_leaf=is_param)
