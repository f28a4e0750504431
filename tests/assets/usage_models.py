"""A tiny mixture-of-experts LM whose FFN uses its params in the ways check mode must follow (issue 24).

``ffn`` picks how the experts' stacked weights ``w_in (experts, mlp, embed)`` / ``w_out (experts, embed, mlp)``
are used:

- ``"soft"``: every expert on every token, ``w_in[e]`` sliced and contracted through ``layout.einsum`` with the
  names its dims keep (exact under every layout);
- ``"misnamed"``: the same with the slice's ``mlp`` called ``hidden`` (a name error on one process already);
- ``"raw"``: ``x @ w_in[e].T`` and ``h @ w_out[e].T`` (right on one process and under FSDP, wrong under TP);
- ``"index"``: top-1 dispatch by index (``torch.nonzero``), tokens flattened to ``tokens embed``;
- ``"capacity"``: GShard-style dispatch into ``experts capacity embed`` slots;

- ``"half"``: half of each expert's width, ``w_in[e][:mlp // 2]`` (a cut of the dim TP shards);
- ``"reshaped"``: ``w_in[e]`` through a reshape (a view whose dims have no names).

``bias="wrong"`` declares the FFN's bias on ``embed`` while it is added to ``mlp`` (same size here);
``bias="short"`` declares it one shorter than ``mlp`` (it does not broadcast).
``stacked=True`` declares the layers as one stack with a leading ``layers`` dim instead of a list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functitan.model import Model, Param, normal
from functitan.sharding import Layout


@dataclass(frozen=True, kw_only=True)
class Cfg:
    vocab_size: int = 48
    dim: int = 8
    mlp: int = 8  # = dim, so a bias declared on the wrong one of them broadcasts on one process
    experts: int = 2
    n_layers: int = 2
    capacity: int = 24  # slots per expert; tokens past it are dropped (the same on every layout)
    ffn: str = "soft"
    bias: str = "right"
    stacked: bool = False
    tie: bool = True  # the head is the token table (False: a head of its own, so PP can place it on the last rank)


def _layer(c: Cfg, lead: tuple[int, ...] = (), names: tuple[str, ...] = ()) -> dict:
    d, m, e = c.dim, c.mlp, c.experts
    bias_names = ("embed",) if c.bias == "wrong" else ("mlp",)
    return {
        "router": Param((*lead, e, d), (*names, "experts", "embed"), normal(0.5)),
        "w_in": Param((*lead, e, m, d), (*names, "experts", "mlp", "embed"), normal(0.4)),
        "b_in": Param((*lead, m - (c.bias == "short")), (*names, *bias_names), normal(0.2)),
        "w_out": Param((*lead, e, d, m), (*names, "experts", "embed", "mlp"), normal(0.4)),
    }


def params(c: Cfg) -> dict:
    layers = _layer(c, (c.n_layers,), ("layers",)) if c.stacked else [_layer(c) for _ in range(c.n_layers)]
    out = {"wte": Param((c.vocab_size, c.dim), ("vocab", "embed"), normal(0.5)), "layers": layers}
    if not c.tie:
        out["head"] = Param((c.vocab_size, c.dim), ("vocab", "embed"), normal(0.5))
    return out


def _expert(p: dict, x: torch.Tensor, e: int, c: Cfg, layout: Layout, names: str) -> torch.Tensor:
    """Expert ``e`` on ``x`` (``names``: its dims, ending in ``embed``) through the Layout."""
    mlp = "hidden" if c.ffn == "misnamed" else "mlp"
    w_in, w_out, b_in = p["w_in"][e], p["w_out"][e], p["b_in"]
    if c.ffn == "half":  # half of each expert's width: a cut of the dim TP shards
        w_in, w_out, b_in = w_in[: c.mlp // 2], w_out[:, : c.mlp // 2], b_in[: c.mlp // 2]
    if c.ffn == "reshaped":  # the same values through a reshape: a view whose dims have no names
        w_in = w_in.reshape(-1).view(c.mlp, c.dim)
    h = layout.einsum(f"{names}, {mlp} embed -> {names[: -len('embed')]}{mlp}", x, w_in) + b_in
    return layout.einsum(f"{names[: -len('embed')]}mlp, embed mlp -> {names}", F.gelu(h), w_out)


def ffn(p: dict, x: torch.Tensor, c: Cfg, layout: Layout) -> torch.Tensor:
    """``x (batch, seq, embed)`` -> the experts' mix, same shape."""
    gates = layout.einsum("batch seq embed, experts embed -> batch seq experts", x, p["router"]).softmax(-1)
    if c.ffn in ("soft", "misnamed", "half", "reshaped"):
        return sum(gates[..., e : e + 1] * _expert(p, x, e, c, layout, "batch seq embed") for e in range(c.experts))
    if c.ffn == "raw":
        out = 0.0
        for e in range(c.experts):
            h = F.gelu(x @ p["w_in"][e].T + p["b_in"])
            out = out + gates[..., e : e + 1] * (h @ p["w_out"][e].T)
        return out
    flat, g = x.flatten(0, 1), gates.flatten(0, 1)  # (tokens, embed), (tokens, experts)
    choice = g.argmax(-1)
    if c.ffn == "index":
        out = torch.zeros_like(flat)
        for e in range(c.experts):
            idx = torch.nonzero(choice == e).squeeze(-1)
            y = _expert(p, flat[idx], e, c, layout, "tokens embed") * g[idx, e : e + 1]
            out = out.index_add(0, idx, y)
        return out.view_as(x)
    # capacity: token t of expert e goes to slot (its rank among e's tokens) if it is below the capacity
    onehot = F.one_hot(choice, c.experts).float()  # (tokens, experts)
    slot = ((onehot.cumsum(0) - 1) * onehot).long()
    kept = onehot * (slot < c.capacity)
    dispatch = kept.unsqueeze(-1) * F.one_hot(slot.clamp(max=c.capacity - 1), c.capacity).float()  # (tokens, e, cap)
    xd = torch.einsum("tec,td->ecd", dispatch, flat)  # (experts, capacity, embed)
    h = F.gelu(
        layout.einsum("experts capacity embed, experts mlp embed -> experts capacity mlp", xd, p["w_in"]) + p["b_in"]
    )
    y = layout.einsum("experts capacity mlp, experts embed mlp -> experts capacity embed", h, p["w_out"])
    return torch.einsum("tec,ecd->td", dispatch * g.unsqueeze(-1), y).view_as(x)


def _blocks(layers, x: torch.Tensor, c: Cfg, layout: Layout) -> torch.Tensor:
    if c.stacked:
        p = layout.params(layers)
        for i in range(c.n_layers):
            x = x + ffn({k: v[i] for k, v in p.items()}, F.layer_norm(x, x.shape[-1:]), c, layout)
        return x
    return layout.blocks(lambda p, x: x + ffn(p, F.layer_norm(x, x.shape[-1:]), c, layout), layers, x)


def _head(p: dict, x: torch.Tensor, batch: dict, c: Cfg, layout: Layout):
    w = p["wte" if c.tie else "head"]
    logits = layout.einsum("batch seq embed, vocab embed -> batch seq vocab", F.layer_norm(x, x.shape[-1:]), w)
    return layout.cross_entropy(logits, batch["targets"], c.vocab_size, reduction="tokens")


def loss(params: dict, batch: dict, c: Cfg, layout: Layout = Layout()):
    top = layout.params({k: v for k, v in params.items() if k != "layers"})
    x = _blocks(params["layers"], layout.embed(batch["inputs"], top["wte"], c.vocab_size), c, layout)
    return _head(top, x, batch, c, layout)


def stage_model(c: Cfg, layout: Layout, *, seq_len: int, dtype: torch.dtype = torch.float32):
    from functitan.pipeline import StageModel

    return StageModel(
        first=lambda p, mb: layout.embed(mb["inputs"], layout.params(p)["wte"], c.vocab_size),
        blocks=lambda layers, x: _blocks(layers, x, c, layout),
        last=lambda p, x, mb: _head(layout.params(p), x, mb, c, layout),
        activation=lambda mb: ((mb["inputs"].shape[0], mb["inputs"].shape[1] // layout.seq_shards, c.dim), dtype),
        n_blocks=c.n_layers,
        first_keys=("wte",),
        last_keys=("wte",) if c.tie else ("head",),
    )


MODEL = Model(
    name="usage",
    configs={"debug": Cfg()},
    params=params,
    loss=loss,
    apply=lambda p, tokens, c, layout: layout.embed(tokens, p["wte"], c.vocab_size),
    flops_per_token=lambda c, s: 1.0,
    stages=stage_model,
)
