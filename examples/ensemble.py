"""An ensemble of models as one vmapped function (JAX's stacked-params idiom) and per-example gradients.

    python examples/ensemble.py

Five debug-Llama-shaped models (tiny dims) are initialised with different keys and their params stacked
leaf by leaf into one tree with a leading ``model`` axis. ``vmap(loss, in_dims=(0, None))`` evaluates all
five on the same batch in one call, and ``vmap(grad(loss), in_dims=(0, None))`` gives every member's gradient,
so one step trains the whole ensemble. The result is checked against a Python loop over the members.
Then ``vmap(grad(loss), in_dims=(None, 0))`` over single examples gives per-example gradients (for
per-example clipping, as in DP-SGD, or influence scores), checked against a loop over examples.
"""

import optree
import torch

from functitan import optim
from functitan.random import key
from functitan.transforms import grad, vmap
from models import llama

CFG = llama.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
MEMBERS = 5


def loss(params, tokens):  # tokens: (batch, seq + 1)
    return llama.loss(params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, CFG)


def main() -> None:
    members = [llama.init(CFG, key(i)) for i in range(MEMBERS)]
    stacked = optree.tree_map(lambda *xs: torch.stack(xs), *members)  # every leaf: (MEMBERS, ...)
    tokens = torch.randint(0, CFG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))

    losses = vmap(loss, in_dims=(0, None))(stacked, tokens)  # (MEMBERS,)
    loop = torch.stack([loss(m, tokens) for m in members])
    torch.testing.assert_close(losses, loop, atol=1e-5, rtol=1e-5)
    print("ensemble losses:", [round(x, 4) for x in losses.tolist()])

    # one SGD step for all members at once
    grads = vmap(grad(loss), in_dims=(0, None))(stacked, tokens)
    opt = optim.sgd(0.5)
    updates, _ = opt.update(grads, opt.init(stacked), stacked)
    stepped = optim.apply_updates(stacked, updates)
    after = vmap(loss, in_dims=(0, None))(stepped, tokens)
    print("after one step:  ", [round(x, 4) for x in after.tolist()])
    assert (after < losses).all()

    # per-example gradients of one member
    one = lambda p, t: loss(p, t[None])  # noqa: E731
    per_example = vmap(grad(one), in_dims=(None, 0))(members[0], tokens)
    for i in range(tokens.shape[0]):
        ref = grad(one)(members[0], tokens[i])
        for a, b in zip(optree.tree_leaves(per_example), optree.tree_leaves(ref)):
            torch.testing.assert_close(a[i], b, atol=2e-6, rtol=1e-4)
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in optree.tree_leaves(per_example)])
    print("per-example gradient norms:", [round(x, 4) for x in norms.norm(dim=0).tolist()])


if __name__ == "__main__":
    import warnings

    # CPU SDPA has no vmap batching rule yet: torch loops over the batch inside and says so once per op
    warnings.filterwarnings("ignore", message="There is a performance drop")
    main()
