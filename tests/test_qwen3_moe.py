"""Qwen3-MoE: published sizes counted as transformers does, HF logits and files both ways, routing and the
grouped experts against plain loops, active-parameter FLOPs, and the balance term's aux path."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # build from configs; nothing may download
transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors.torch")

from functitan import checkpoint as ckpt  # noqa: E402
from functitan.model import count, init  # noqa: E402
from functitan.moe import Router, grouped_mm, route, routed_experts  # noqa: E402
from models import qwen3_moe  # noqa: E402

M = qwen3_moe.MODEL
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
LOGITS_ATOL = 1e-5  # fp32; measured max |ours - HF| 1.4e-6 (the experts' summation order, RoPE tables)


@pytest.mark.parametrize("flavor", ["30b_a3b", "235b_a22b"])
def test_published_sizes_count_exactly_as_transformers(flavor):
    cfg = M.config(flavor)
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in qwen3_moe.config_to_hf(cfg).items() if k != "model_type"})
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_cfg)
    total = sum(p.numel() for p in hf.parameters())
    assert count(M.params(cfg)) == total
    assert qwen3_moe.config_from_hf(hf_cfg.to_dict()) == cfg
    # the active parameters: the published "A3B" / "A22B" (3.3B and 22B by Qwen's report)
    idle = (cfg.experts - cfg.top_k) * 3 * cfg.dim * cfg.moe_ffn_dim * cfg.n_layers
    assert qwen3_moe.active_params(cfg) == total - idle
    expected = {"30b_a3b": (30.5e9, 3.3e9), "235b_a22b": (235.1e9, 22.2e9)}[flavor]
    assert total == pytest.approx(expected[0], rel=2e-3)
    assert qwen3_moe.active_params(cfg) == pytest.approx(expected[1], rel=2e-2)


def test_flops_count_the_active_parameters_not_every_expert():
    cfg = M.config("30b_a3b")
    dense_all = M.config("30b_a3b", top_k=128)  # every expert active: the dense upper bound
    ratio = qwen3_moe.flops_per_token(cfg, 4096) / qwen3_moe.flops_per_token(dense_all, 4096)
    assert 0.08 < ratio < 0.2  # 3.3B of 30.5B params, plus the attention term both share


def _hf_model(seed: int = 0, norm_topk: bool = True):
    """A tiny random Qwen3MoeForCausalLM, every weight (norms too) random; layer 1 of 3 dense."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk,
        mlp_only_layers=[1],
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("norm_topk", [True, False])
def test_load_hf_logits_match_transformers_and_export_round_trips_byte_exact(tmp_path, norm_topk):
    model = _hf_model(norm_topk=norm_topk)
    model.save_pretrained(tmp_path / "src")
    cfg, params = ckpt.load_hf(tmp_path / "src", M)
    assert (cfg.experts, cfg.top_k, cfg.norm_topk, cfg.mlp_only_layers) == (8, 3, norm_topk, (1,))
    assert "moe" in params["layers"][0] and "mlp" in params["layers"][1]
    with torch.no_grad():
        theirs = model(TOKENS).logits
    ours = M.apply(params, TOKENS, cfg)
    assert ours.shape == theirs.shape == (2, 20, 96)
    assert (ours - theirs).abs().max().item() < LOGITS_ATOL
    ckpt.save_hf(params, M, cfg, tmp_path / "out")
    from safetensors.torch import load_file

    src, out = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(src) == sorted(out)  # one key per expert and matrix, as the hub stores them
    for k in src:
        assert torch.equal(src[k], out[k]), k  # byte-exact
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, theirs)


def test_softmax_routing_equals_transformers_router():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for norm in (True, False):
        cfg = transformers.Qwen3MoeConfig(hidden_size=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        hf = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(hf.weight)
        x = torch.randn(40, 24)
        _, their_w, their_i = hf(x)
        w, i, _ = route(x @ hf.weight.T, Router(experts=8, top_k=3, norm_topk=norm))
        assert torch.equal(i, their_i)
        torch.testing.assert_close(w, their_w.float(), atol=1e-7, rtol=1e-6)


def test_group_limited_sigmoid_routing_equals_deepseek_v3_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(
        hidden_size=24,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=8,
        n_shared_experts=1,
    )
    hf = DeepseekV3MoE(cfg).gate
    torch.nn.init.normal_(hf.weight)
    torch.nn.init.normal_(hf.e_score_correction_bias, std=0.3)
    x = torch.randn(64, 24)
    logits, their_w, their_i = hf(x)
    router = Router(experts=16, top_k=4, score="sigmoid", norm_topk=True, n_group=4, topk_group=2, scale=2.5)
    w, i, _ = route(logits, router, hf.e_score_correction_bias)
    # the same experts per token (top-k's order may differ between equal-ranked sets: compare sorted)
    order, their_order = i.sort(-1), their_i.sort(-1)
    assert torch.equal(order.values, their_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), their_w.gather(1, their_order.indices), atol=1e-6, rtol=1e-6)
    # the bias moves the choice, not the weights: a large bias on expert 0 picks it for every token
    bias = torch.zeros(16)
    bias[0] = 100.0
    w0, i0, scores = route(logits, router, bias)
    assert (i0 == 0).any(-1).all()
    picked = w0.gather(1, (i0 == 0).float().argmax(-1, keepdim=True)).squeeze(1)
    unbiased = scores[:, 0] / scores.gather(1, i0).sum(-1) * 2.5
    torch.testing.assert_close(picked, unbiased)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_a_loop_over_experts_forward_and_backward(dtype):
    g = torch.Generator().manual_seed(0)
    tokens, dim, ffn, n, k = 37, 32, 24, 6, 2
    x = torch.randn(tokens, dim, generator=g).to(dtype).requires_grad_()
    p = {
        "w_gate": (0.2 * torch.randn(n, ffn, dim, generator=g)).to(dtype).requires_grad_(),
        "w_up": (0.2 * torch.randn(n, ffn, dim, generator=g)).to(dtype).requires_grad_(),
        "w_down": (0.2 * torch.randn(n, dim, ffn, generator=g)).to(dtype).requires_grad_(),
    }
    experts = torch.randint(0, n - 1, (tokens, k), generator=g)  # expert n-1 gets no token
    experts[:, 1] = (experts[:, 0] + 1) % (n - 1)
    weights = torch.rand(tokens, k, generator=g)
    out = routed_experts(x, experts, weights, p)
    ref = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            e = experts[t, j]
            h = torch.nn.functional.silu(x[t] @ p["w_gate"][e].T) * (x[t] @ p["w_up"][e].T)
            ref[t] = ref[t] + weights[t, j].to(dtype) * (h @ p["w_down"][e].T)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, ref, **tol)
    cot = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, [x, *p.values()], cot)
    refs = torch.autograd.grad(ref, [x, *p.values()], cot)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, **tol)
    assert grads[-1][n - 1].abs().max() == 0  # the expert no token chose: a zero gradient


def test_grouped_mm_falls_back_where_the_kernel_refuses_the_width():
    x, w = torch.randn(9, 6), torch.randn(3, 5, 6)  # 6 and 5 floats: rows not a multiple of 16 bytes
    counts = torch.tensor([4, 0, 5])
    out = grouped_mm(x, w, counts)
    torch.testing.assert_close(out, torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T]))


def test_the_loss_adds_the_balance_term_and_reports_each_experts_share():
    cfg = M.config("debug", vocab_size=64)
    params = init(M.params(cfg), 0)
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    targets = tokens.clone()
    targets[0, :5] = -100  # a prompt: no loss there
    loss, aux = M.loss(params, {"inputs": tokens, "targets": targets}, cfg)
    plain = M.loss(params, {"inputs": tokens, "targets": targets}, M.replace(cfg, balance=0.0))[0]
    assert loss.count == plain.count == (targets != -100).sum()
    assert aux["load"].sum.sum() == aux["load"].count == 3 * 16 * cfg.top_k * cfg.n_layers
    # the balance term by hand: per layer and sequence, sum_i f_i P_i, weighted by the sequence's valid targets
    from functitan.sharding import Layout

    x = qwen3_moe.qwen3.embed(params, tokens, cfg, Layout())
    by_hand = torch.zeros(())
    for p in params["layers"]:
        x_attn = x + qwen3_moe.qwen3.attention(
            p["attn"], qwen3_moe.rms_norm(x, p["attn_norm"]["weight"], cfg.norm_eps, Layout()), cfg, Layout()
        )
        h = qwen3_moe.rms_norm(x_attn, p["mlp_norm"]["weight"], cfg.norm_eps, Layout())
        probs = (h @ p["moe"]["router"]["weight"].T).softmax(-1)  # (3, 16, experts)
        chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(cfg.top_k, -1).indices, 1.0)
        f = chosen.mean(1) * cfg.experts / cfg.top_k  # (3, experts)
        per_seq = cfg.balance * (f * probs.mean(1)).sum(-1)  # (3,)
        by_hand = by_hand + (per_seq * (targets != -100).sum(1)).sum()
        x = qwen3_moe.block(p, x, cfg, Layout())[0]
    torch.testing.assert_close(loss.sum - plain.sum, by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux["balance"].sum, by_hand, atol=1e-5, rtol=1e-5)


# ---- every layout equals one process (gloo pool, fp32) -----------------------------------------------------------

# 2 steps of SGD at lr 1 (the second step routes with the updated router), gradients of the loss with the balance
# term; measured max |grad - one process| <= 3e-8 over every param of every layout
MOE_LAYOUTS = {
    2: ("ddp", "fsdp", "tp", "tp_sp", "cp", "ep", "ep_tp", "pp_1f1b"),
    4: (
        *("hsdp", "fsdp_tp_sp", "cp_tp_sp", "fsdp_ep", "ep4", "hsdp_ep", "ep_tp_sp", "ep4_tp_sp", "cp_ep"),
        *("ep4_cp_tp_sp", "pp_ep", "pp_fsdp_zb"),
    ),
}


def _gradcheck_ranks(layouts):
    from functitan.model import _gradcheck

    return _gradcheck._worker("qwen3_moe", "debug", {"vocab_size": 64}, layouts, 4, 16, 0, 2)


@pytest.mark.parametrize("world", sorted(MOE_LAYOUTS))
def test_every_layout_equals_one_process_losses_and_every_gradient(world, gloo):
    from functitan.model import _gradcheck

    wait = gloo.submit(_gradcheck_ranks, world, MOE_LAYOUTS[world])
    ref_losses, ref_grads, ref_change = _gradcheck._train("qwen3_moe", "debug", {"vocab_size": 64}, None, 4, 16, 0, 2)
    from support import merged_ranks

    got = merged_ranks(wait())  # a pipeline rank holds its stages' params
    assert "moe" in "".join(ref_grads) and any(g.abs().max() > 0 for n, g in ref_grads.items() if "experts" in n)
    for lname in MOE_LAYOUTS[world]:
        losses, grads, change = got[lname]
        assert losses is not None, f"{lname}: {grads}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6, rtol=0)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=0, msg=f"{lname} {name}")
            torch.testing.assert_close(change[name], ref_change[name], atol=1e-6, rtol=0, msg=f"{lname} {name}@2")


def _train_moe(layout: dict, run_dir: str, name: str):
    from support import SMALL, train_small

    base = {k: v for k, v in SMALL.items() if not k.startswith("model.")}
    over = {"model.name": "qwen3_moe", "model.flavor": "debug", "training.steps": 3, **layout}
    losses, params, _ = train_small({**over, "metrics.run_dir": run_dir, "metrics.run_name": name}, base)
    return losses, params


def test_the_trainer_with_remat_equals_one_process_and_reports_the_experts_load(tmp_path, gloo):
    layouts = {
        "fsdp2_full": {"parallelism.dp_shard": 2, "training.remat": "full"},
        "tp2_sp_selective": {
            "parallelism.dp_shard": 1,
            "parallelism.tp": 2,
            "parallelism.sequence_parallel": True,
            "training.remat": "selective",
        },
        # the stages carry the aux: the balance term joins the loss on its stage, load and balance the metrics
        "pp2_mb2": {"parallelism.dp_shard": 1, "parallelism.pp": 2, "training.microbatches": 2},
    }
    ep = {  # AdamW, 3 steps, 2 microbatches: ep 2 x efsdp 2 with full remat, ep 4, and ep 2 on tp's ranks
        "fsdp4_ep2_full": {"parallelism.dp_shard": 4, "parallelism.ep": 2, "training.remat": "full"},
        "ep4_mb2": {"parallelism.dp_shard": 4, "parallelism.ep": 4, "training.microbatches": 2},
        "fsdp2_tp2_ep2": {
            "parallelism.dp_shard": 2,
            "parallelism.tp": 2,
            "parallelism.sequence_parallel": False,
            "parallelism.ep": 2,
        },
    }
    wait = gloo.submit(_run_layouts, 2, layouts, str(tmp_path))
    ref_losses, ref_params = _train_moe({}, str(tmp_path), "ref")
    got = wait()[0]
    got.update(gloo.run(_run_layouts, 4, ep, str(tmp_path))[0])
    for lname, (losses, params) in got.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=2e-5, rtol=1e-4)
        for k, p in params.items():
            torch.testing.assert_close(p, ref_params[k], atol=1e-4, rtol=1e-3, msg=f"{lname} {k}")
    import json

    def aux(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k.startswith("aux/")} for line in lines]

    records = aux("ref")
    shares = [records[0][f"aux/load/{i}"] for i in range(8)]
    assert sum(shares) == pytest.approx(1.0)  # each expert's share of the routed tokens
    assert records[0]["aux/load/max_over_mean"] == pytest.approx(max(shares) * 8)
    assert records[0]["aux/balance"] > 0
    for name in ("pp2_mb2", "fsdp4_ep2_full"):  # added over stages and microbatches, or ranks, as one process
        got_aux = aux(name)  # step 1 routes with the same params: the same shares (later steps may flip a tie)
        assert [r.keys() for r in got_aux] == [r.keys() for r in records]
        assert got_aux[0] == pytest.approx(records[0], rel=1e-5, abs=1e-7), name


def _run_layouts(layouts: dict, run_dir: str):
    return {name: _train_moe(layout, run_dir, name) for name, layout in layouts.items()}


def test_pipeline_parallelism_runs_moe_built_from_pieces_and_refuses_a_model_with_its_own_stages():
    import dataclasses

    from functitan._model_setup import check_model

    cfg = M.config("debug")
    check_model(M, cfg, tp=1, pp=2, seq_len=16, sequence_parallel=False)  # Pieces: the stages carry the aux
    own = dataclasses.replace(M, pieces=None)  # the same model with its own apply, loss and stages
    with pytest.raises(
        ValueError, match=r"parallelism.pp=2: model 'qwen3_moe' has mixture-of-experts layers .* gives its own stages"
    ):
        check_model(own, cfg, tp=1, pp=2, seq_len=16, sequence_parallel=False)


CLI_RUN = {"model.name": "qwen3_moe", "model.flavor": "debug", "training.steps": 3, "training.seq_len": 32,
           "training.batch_size": 4, "data.max_corpus_bytes": 200_000, "optimizer.eps": 1e-6,
           "metrics.log_every": 1}  # fmt: skip


def test_train_cli_as_typed_with_ep_on_the_tp_ranks_equals_one_process(tmp_path, gloo):
    """``functitan train --nproc 2 --parallelism.tp=2 --parallelism.ep=2`` (SP on by default; dp_shard has one
    rank, so the experts' group is tp's two ranks): each step's loss equals the trainer's on one process."""
    from support import train_small

    ref, *_ = gloo.run(
        train_small, 1, {**CLI_RUN, "metrics.run_dir": str(tmp_path), "metrics.run_name": "one"}, base={}
    )[0]
    flags = [f"--{k}={v}" for k, v in CLI_RUN.items()]
    layout = ["--parallelism.tp=2", "--parallelism.ep=2"]
    out = subprocess.run(
        [sys.executable, "-m", "functitan.cli", "train", "--nproc", "2", *layout, *flags]
        + [f"--metrics.run_dir={tmp_path}", "--metrics.run_name=ep"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "layout ep=2 tp=2 on 2 processes" in out.stdout  # ep as configured
    got = [json.loads(line)["loss"] for line in (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()]
    assert len(got) == len(ref) == 3 and got[-1] < got[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=2e-5, rtol=1e-4)


def _expert_shards(degrees: dict) -> dict:
    """This rank's local shapes of a MoE layer's params under ``degrees`` (ep borrows from dp_shard x cp x tp)."""
    from functitan.mesh import make_mesh
    from functitan.model import specs
    from functitan.sharding import Layout, default_rules, place

    cfg = M.config("debug")
    mesh = make_mesh(**degrees, device="cpu")
    params = place(init(M.params(cfg), 0), specs(M.params(cfg)), default_rules(), mesh)
    moe = params["layers"][0]["moe"]
    return {
        "w_gate": tuple(moe["experts"]["w_gate"].to_local().shape),
        "router": tuple(moe["router"]["weight"].to_local().shape),
        "ep": Layout(mesh).expert_parallel.size if Layout(mesh).expert_parallel else 1,
    }


def test_ep_ranks_hold_their_share_of_the_experts_and_fsdp_shards_the_rest(gloo):
    # debug: 8 experts of (32, 64), a router of (8, 64); ep borrows from dp_shard x cp x tp,
    # efsdp = dp_shard * cp * tp / ep
    ep4, ep2, tp, tp_ep4, cp_tp = (
        gloo.run(_expert_shards, 4, degrees)[0]
        for degrees in (
            {"dp_shard": 4, "ep": 4},
            {"dp_shard": 4, "ep": 2},
            {"dp_shard": 2, "tp": 2, "ep": 2},
            {"dp_shard": 2, "tp": 2, "ep": 4},
            {"dp_shard": 1, "cp": 2, "tp": 2, "ep": 4},
        )
    )
    # dense params (the router) are FSDP-sharded over the whole dp_shard degree, ep's ranks included, as without ep
    assert ep4 == {"w_gate": (2, 32, 64), "router": (8, 16), "ep": 4}  # 2 whole experts (efsdp = 1)
    assert ep2 == {"w_gate": (4, 32, 32), "router": (8, 16), "ep": 2}  # 4 experts, and FSDP over efsdp = 2
    # ep on tp's ranks: 4 experts each, FSDP over dp_shard (efsdp 2); and ep over dp_shard x tp (efsdp 1)
    assert tp == {"w_gate": (4, 32, 32), "router": (8, 32), "ep": 2}
    assert tp_ep4 == {"w_gate": (2, 32, 64), "router": (8, 32), "ep": 4}
    assert cp_tp == {"w_gate": (2, 32, 64), "router": (8, 32), "ep": 4}  # ep over cp x tp; the router FSDP over cp


def test_ep_spans_all_of_cp_x_tp_and_takes_the_rest_from_dp_shard():
    from functitan.mesh import check_ep

    assert check_ep(4, 4) == 4 and check_ep(2, 4, cp=2) == 1 and check_ep(4, 4, tp=2) == 2 and check_ep(1, 3, tp=2) == 1
    assert check_ep(8, 2, cp=2, tp=2) == 2
    with pytest.raises(ValueError) as e:
        check_ep(2, 2, tp=4)
    assert str(e.value) == (
        "parallelism.ep=2: expert parallelism borrows its ranks from parallelism.dp_shard=2 x cp=1 x tp=4, so ep "
        "must be a multiple of cp x tp = 4 that divides it; choose ep among [1, 4, 8] (or raise dp_shard)"
    )


def test_an_ep_that_does_not_divide_dp_shard_is_one_line_before_any_process_group_forms(monkeypatch):
    import torch.distributed as dist
    from support import cli

    if dist.is_initialized():  # a one-process group an earlier in-process run left: the world would be 1
        dist.destroy_process_group()
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it for each of 4 workers
    out = cli("train", "--model.name=qwen3_moe", "--parallelism.dp_shard=4", "--parallelism.ep=3")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "functitan: error: parallelism.ep=3: expert parallelism borrows its ranks from parallelism.dp_shard=4, so "
        "ep must divide it; choose ep among [1, 2, 4] (or raise dp_shard)"
    )


def test_an_ep_the_experts_cannot_split_by_is_named_before_step_1():
    from functitan._model_setup import check_model
    from functitan.model import load_model

    kw = dict(tp=1, pp=1, seq_len=16, sequence_parallel=False)
    with pytest.raises(ValueError, match="parallelism.ep=2 does not divide the model's 5 routed experts"):
        check_model(M, M.config("debug", experts=5), ep=2, **kw)
    llama = load_model("llama")
    with pytest.raises(ValueError, match="parallelism.ep=2: model 'llama' has no routed experts"):
        check_model(llama, llama.config("debug"), ep=2, **kw)
    check_model(M, M.config("debug"), ep=4, **kw)


def test_the_planner_offers_expert_parallel_and_pipelined_moe_layouts_and_names_what_cannot_split():
    from functitan.model import load_model
    from functitan.plan._candidates import enumerate_candidates

    cfg = M.config("debug")  # 8 routed experts
    kw = dict(world=4, per_node=4, batch_size=8, seq_len=64, n_blocks=2)
    cands, pruned = enumerate_candidates(M, cfg, **kw)
    assert any(c.pp == 2 for c in cands)
    assert {c.ep for c in cands} == {1, 2, 4}
    # ep spans all of cp x tp and a divisor of dp_shard: efsdp = dp_shard * cp * tp / ep
    assert all(c.ep == 1 or (c.ep % (c.cp * c.tp) == 0 and c.efsdp * c.ep == c.dp_shard * c.cp * c.tp) for c in cands)
    assert any(c.ep == 2 and c.tp == 2 and c.dp_shard == 2 for c in cands)  # ep on tp's ranks
    assert not any("mixture-of-experts" in why for why in pruned)
    six, pruned6 = enumerate_candidates(M, cfg, **{**kw, "world": 6, "per_node": 6, "batch_size": 12})
    assert {c.ep for c in six} == {1, 2}  # 3 and 6 do not divide 8 experts
    assert pruned6["ep=3: does not divide the model's 8 routed experts"] > 0
    dense, _ = enumerate_candidates(load_model("llama"), load_model("llama").config("debug"), **kw)
    assert {c.ep for c in dense} == {1}


# ---- checkpoints move between expert-parallel layouts ------------------------------------------------------------

EP_RESUME = {"checkpoint.enable": True, "checkpoint.interval": 3, "checkpoint.keep_last": 2, "training.steps": 5}


def _ep4_then_other_layouts(root: str):
    """fsdp 4 x ep 4 straight for 5 steps; the same run cut after step 3 (its checkpoint holds each rank's 2
    experts and their AdamW moments) resumed as fsdp 4 x ep 2, as fsdp 4 (ep 1), as fsdp 2 x tp 2 x ep 4 (ep over
    dp_shard and tp's ranks) and as pp 2 x fsdp 2 (rank 0: the first stage's params), each in a copy of the run."""
    import shutil

    from support import Crash, crashing_at_step

    ep4 = {"parallelism.dp_shard": 4, "parallelism.ep": 4, **EP_RESUME}
    straight = _train_moe(ep4, root, "straight")
    with crashing_at_step(3), contextlib.suppress(Crash):
        _train_moe(ep4, root, "cut")
    out = {}
    resumed = {
        "ep2": {"parallelism.dp_shard": 4, "parallelism.ep": 2},
        "ep1": {"parallelism.dp_shard": 4, "parallelism.ep": 1},
        "tp2_ep4": {"parallelism.dp_shard": 2, "parallelism.tp": 2, "parallelism.ep": 4},
        "pp2": {"parallelism.pp": 2, "parallelism.dp_shard": 2, "training.microbatches": 2},
    }
    for name, layout in resumed.items():
        if torch.distributed.get_rank() == 0:
            shutil.copytree(f"{root}/cut", f"{root}/{name}")
        torch.distributed.barrier()
        out[name] = _train_moe({**layout, **EP_RESUME}, root, name)
    return straight, out


def test_an_ep4_checkpoint_resumes_under_ep2_ep1_tp_ep4_and_pp2_with_its_optimizer_state(tmp_path, gloo):
    straight, moved = gloo.run(_ep4_then_other_layouts, 4, str(tmp_path), timeout=280)[0]
    for name, (losses, params) in moved.items():
        assert len(losses) == 5  # the cut run's steps 1-3, then 4 and 5 resumed (a fresh start would log 1-5 again)
        # steps 4 and 5 continue the ep 4 run: restored params and AdamW moments, resharded by experts
        torch.testing.assert_close(torch.tensor(losses[-2:]), torch.tensor(straight[0][-2:]), atol=2e-5, rtol=1e-4)
        for k, p in params.items():
            torch.testing.assert_close(p, straight[1][k], atol=1e-4, rtol=1e-3, msg=f"{name} {k}")
