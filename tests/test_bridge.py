"""functitan/bridge.py: a transformers LlamaForCausalLM trained through the bridge under FSDP equals torch's own
training of it; tensor parallelism on its nn.Linear layers is refused by name."""

import pytest
import torch
import torch.nn.functional as F

from functitan import optim
from functitan.bridge import TensorParallelBridgeError, from_module, specs_from_rules

transformers = pytest.importorskip("transformers")

# logical names by rules on HF Llama's parameter names (first match wins)
RULES = [
    (r"embed_tokens\.weight$", ("vocab", "embed")),
    (r"lm_head\.weight$", ("vocab", "embed")),
    (r"q_proj\.weight$", ("heads", "embed")),
    (r"(k|v)_proj\.weight$", ("kv_heads", "embed")),
    (r"o_proj\.weight$", ("embed", "heads")),
    (r"(gate|up)_proj\.weight$", ("mlp", "embed")),
    (r"down_proj\.weight$", ("embed", "mlp")),
    (r"norm\.weight$", ("embed",)),
]
LR, WD, STEPS = 1e-2, 0.01, 4


def _model():
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def _batches():
    t = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]}] * STEPS  # one batch, memorised: the loss must fall


def _ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _torch_losses():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for b in _batches():
        opt.zero_grad()
        loss = _ce(model(b["inputs"]).logits, b["targets"])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _bridge_worker():
    import torch.distributed as dist

    from functitan.mesh import make_mesh
    from functitan.random import key
    from functitan.sharding import Layout, default_rules, place
    from functitan.step import make_train_step
    from functitan.train_state import TrainState
    from functitan.transforms import value_and_grad

    model = _model()
    apply, params, specs = from_module(model, RULES)
    mesh = make_mesh(dp_shard=2)
    layout = Layout(mesh, default_rules())
    params = place(params, specs, default_rules(), mesh)
    opt = optim.adamw(LR, weight_decay=WD, mask=None)  # torch.optim.AdamW decays every param

    def loss(p, b):
        return _ce(apply(p, b["inputs"], layout=layout).logits, b["targets"])

    step = make_train_step(value_and_grad(loss), opt)
    state = TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=key(0))
    r = dist.get_rank()
    losses = []
    for b in _batches():
        state, out = step(state, {k: v[2 * r : 2 * r + 2] for k, v in b.items()})  # each rank half the batch
        losses.append(out["loss"])
    sharded = type(state.params["model.layers.0.mlp.up_proj.weight"]).__name__
    try:
        tp_layout = Layout(make_mesh(tp=2), default_rules())
        apply(
            place(dict(model.named_parameters()), specs, default_rules(), tp_layout.mesh),
            _batches()[0]["inputs"],
            layout=tp_layout,
        )
        tp_error = None
    except TensorParallelBridgeError as e:
        tp_error = str(e)
    return losses, sharded, tp_error


def test_transformers_llama_trained_through_the_bridge_under_fsdp_matches_torch_adamw(gloo):
    want = _torch_losses()
    (losses, sharded, tp_error), _ = gloo.run(_bridge_worker, 2, timeout=240)
    assert sharded == "DTensor"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), atol=2e-5, rtol=1e-5)
    assert want[-1] < want[0] - 0.5  # it trained
    assert (
        tp_error is not None
        and "'model.embed_tokens.weight' (spec ('vocab', 'embed')) would be split over tp=2" in tp_error
    )


def test_rules_name_the_unmatched_parameter_and_a_wrong_length():
    with pytest.raises(ValueError, match=r"no rule matches the parameter 'x.bias' of shape \(3,\); add a"):
        specs_from_rules({"x.bias": torch.zeros(3)}, [(r"weight$", ("embed",))])
    with pytest.raises(ValueError, match=r"gives the spec \('embed',\) \(1 names\) to a parameter of shape \(3, 3\)"):
        specs_from_rules({"x.weight": torch.zeros(3, 3)}, [(r"weight$", ("embed",))])
