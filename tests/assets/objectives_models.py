"""A tiny transformer with the objectives users train that are not a mean over every token.

``objective``: ``"given"`` (the batch's targets as they are, ``-100`` where no token counts), ``"mlm"`` (15% of
positions masked, chosen from the tokens themselves so every layout masks the same ones; the count varies by
row), ``"sft"`` (a prompt of ragged length per row, not trained on). ``reduction="tokens"`` returns a
``TokenLoss`` (the trainer normalises over the step's valid tokens); ``"mean"`` this rank's mean (the old
contract). ``balance``: Switch's load-balancing term from ``layout.token_sum``. ``router_z``: a router z-loss
on the residual stream (sequence-sharded under SP) through ``layout.token_mean``, normalised over the same
tokens; ``naive_z``: the same term as a per-rank mean, whose gradient SP counts tp times (for the before /
after numbers). ``aux``: the loss also returns its parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functitan.model import Model, Param, TokenLoss, normal, ones
from functitan.sharding import Layout

IGNORE = -100


@dataclass(frozen=True, kw_only=True)
class Cfg:
    vocab_size: int = 48
    dim: int = 16
    n_heads: int = 2
    n_layers: int = 2
    experts: int = 4
    max_seq: int = 64
    head: str = "tied"  # "tied": the vocab-sharded table; "replicated": a head no rule shards
    objective: str = "given"
    reduction: str = "tokens"
    label_smoothing: float = 0.0
    z_loss: float = 0.0  # cross_entropy's own z-loss
    router_z: float = 0.0
    naive_z: bool = False
    balance: float = 0.0  # a load-balancing term through layout.token_sum (a per-batch statistic: exact where one
    # data-parallel rank holds the batch; the mean of per-rank terms otherwise, as Switch's)
    aux: bool = False
    wrong_stage: bool = False  # the pipeline's first stage forgets the position table (gradcheck's pp layouts)


def params(c: Cfg) -> dict:
    d = c.dim
    layer = lambda: {  # noqa: E731
        "ln1": Param((d,), ("embed",), ones()),
        "qkv": Param((3, d, d), ("qkv", "heads", "embed"), normal(0.3)),
        "proj": Param((d, d), ("embed", "heads"), normal(0.3)),
        "ln2": Param((d,), ("embed",), normal(0.2, 1.0)),
        "fc": Param((2 * d, d), ("mlp", "embed"), normal(0.3)),
        "out": Param((d, 2 * d), ("embed", "mlp"), normal(0.3)),
        "router": Param((c.experts, d), ("experts", "embed"), normal(0.5)),
    }
    out = {
        "wte": Param((c.vocab_size, d), ("vocab", "embed"), normal(0.3)),
        "wpe": Param((c.max_seq, d), ("pos", "embed"), normal(0.3)),
        "layers": [layer() for _ in range(c.n_layers)],
    }
    if c.head == "replicated":
        out["head"] = Param((c.vocab_size, d), ("out_vocab", "embed"), normal(0.3))
    return out


def _norm(x: torch.Tensor, w: torch.Tensor, layout: Layout) -> torch.Tensor:
    return layout.einsum("batch seq embed, embed -> batch seq embed", F.layer_norm(x, x.shape[-1:]), w)


def block(p: dict, x: torch.Tensor, c: Cfg, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, router logits (batch, seq piece, experts))``: the router reads the residual stream, so under SP each
    rank holds its piece of the sequence."""
    b = x.shape[0]
    h = _norm(x, p["ln1"], layout)
    qkv = layout.einsum("batch seq embed, qkv heads embed -> batch seq qkv heads", h, p["qkv"])
    q, k, v = (t.reshape(b, qkv.shape[1], -1, c.dim // c.n_heads).transpose(1, 2) for t in qkv.unbind(2))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    x = x + layout.einsum("batch seq heads, embed heads -> batch seq embed", o, p["proj"])
    h = _norm(x, p["ln2"], layout)
    router = layout.einsum("batch seq embed, experts embed -> batch seq experts", h, p["router"])
    h = F.gelu(layout.einsum("batch seq embed, mlp embed -> batch seq mlp", h, p["fc"]))
    x = x + layout.einsum("batch seq mlp, embed mlp -> batch seq embed", h, p["out"])
    return x, router.float()


def embed(top: dict, tokens: torch.Tensor, c: Cfg, layout: Layout) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return layout.embed(tokens, top["wte"], c.vocab_size) + layout.embed(pos, top["wpe"], c.max_seq)


def head(top: dict, x: torch.Tensor, c: Cfg, layout: Layout) -> torch.Tensor:
    x = F.layer_norm(x, x.shape[-1:])
    if c.head == "replicated":
        return layout.einsum("batch seq embed, out_vocab embed -> batch seq out_vocab", x, top["head"])
    return layout.einsum("batch seq embed, vocab embed -> batch seq vocab", x, top["wte"])


def objective(batch: dict, c: Cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of the objective, from the batch alone (the same on every layout)."""
    inputs, targets = batch["inputs"], batch["targets"]
    pos = torch.arange(inputs.shape[1], device=inputs.device)
    if c.objective == "mlm":
        masked = (inputs * 37 + pos * 11 + inputs[:, :1] * 5) % 100 < 15
        return inputs.masked_fill(masked, 0), torch.where(masked, inputs, IGNORE)
    if c.objective == "sft":
        prompt = inputs[:, :1] % (inputs.shape[1] // 2) + 1  # (batch, 1): ragged prompt lengths
        return inputs, targets.masked_fill(pos < prompt, IGNORE)
    return inputs, targets


def loss(params: dict, batch: dict, c: Cfg, layout: Layout = Layout()):
    inputs, targets = objective(batch, c)
    top = layout.params({k: v for k, v in params.items() if k != "layers"})
    x = embed(top, inputs, c, layout)
    routers = []
    for p in params["layers"]:
        x, router = layout.block(lambda p, x: block(p, x, c, layout), p, x)
        routers.append(router)
    valid = targets != IGNORE
    ce = layout.cross_entropy(
        head(top, x, c, layout),
        targets,
        c.vocab_size,
        label_smoothing=c.label_smoothing,
        z_loss=c.z_loss,
        reduction=c.reduction,
    )
    parts = {"ce": ce}  # a TokenLoss: the step reports its sum over its count, over every rank and microbatch
    out = ce
    if c.router_z:
        zs = sum(torch.logsumexp(r, -1).square() for r in routers)  # (batch, seq piece)
        if c.naive_z:  # this rank's tokens only, as a mean: right on one process, tp times the gradient under SP
            lo, hi = layout.seq_range(targets.shape[1])
            local = valid[:, lo:hi].float()
            term = (zs * local).sum() / local.sum()
        else:
            term = layout.token_mean(zs, valid)  # over the same tokens as ce: its sum adds to ce's
        parts["router_z"] = term
        if isinstance(ce, TokenLoss):
            out = TokenLoss(ce.sum + c.router_z * term.sum, ce.count)
        else:
            out = ce + c.router_z * (term.mean() if isinstance(term, TokenLoss) else term)
    if c.balance:  # Switch's load balancing: experts * sum_e f_e P_e over this batch's tokens, per layer
        n = targets.numel()
        for r in routers:
            probs = r.softmax(-1)  # (batch, seq piece, experts)
            chosen = F.one_hot(r.argmax(-1), c.experts).float()
            f, P = layout.token_sum(chosen) / n, layout.token_sum(probs) / n  # (experts,): whole sequence, once
            lb = c.experts * (f * P).sum()
            parts["balance"] = parts.get("balance", 0.0) + lb
        out = (
            TokenLoss(out.sum + c.balance * parts["balance"] * out.count, out.count)
            if isinstance(out, TokenLoss)
            else out + c.balance * parts["balance"]
        )
    return (out, parts) if c.aux else out


def apply(params: dict, tokens: torch.Tensor, c: Cfg, layout: Layout = Layout()) -> torch.Tensor:
    top = layout.params({k: v for k, v in params.items() if k != "layers"})
    x = embed(top, tokens, c, layout)
    for p in params["layers"]:
        x, _ = layout.block(lambda p, x: block(p, x, c, layout), p, x)
    return head(top, x, c, layout)


def stage_model(c: Cfg, layout: Layout, *, seq_len: int, dtype: torch.dtype = torch.float32):
    """Pipeline stages: embeddings, blocks, head + loss (the router term stays out: a stage passes only x)."""
    from functitan.pipeline import StageModel

    def last(p: dict, x: torch.Tensor, mb: dict):
        _, targets = objective(mb, c)
        logits = head(layout.params(p), x, c, layout)
        opts = dict(label_smoothing=c.label_smoothing, z_loss=c.z_loss, reduction=c.reduction)
        return layout.cross_entropy(logits, targets, c.vocab_size, **opts)

    def first(top: dict, tokens: torch.Tensor) -> torch.Tensor:
        if c.wrong_stage:
            return layout.embed(tokens, top["wte"], c.vocab_size)
        return embed(top, tokens, c, layout)

    return StageModel(
        first=lambda p, mb: first(layout.params(p), objective(mb, c)[0]),
        blocks=lambda layers, x: layout.blocks(lambda p, x: block(p, x, c, layout)[0], layers, x),
        last=last,
        activation=lambda mb: ((mb["inputs"].shape[0], mb["inputs"].shape[1] // layout.seq_shards, c.dim), dtype),
        n_blocks=c.n_layers,
        first_keys=("wte", "wpe"),
        last_keys=("head",) if c.head == "replicated" else ("wte",),
    )


MODEL = Model(
    name="objectives",
    configs={"debug": Cfg(), "mlm": Cfg(objective="mlm"), "sft": Cfg(objective="sft")},
    params=params,
    loss=loss,
    apply=apply,
    flops_per_token=lambda c, s: 6.0 * 8 * c.n_layers * c.dim**2,
    stages=stage_model,
)
