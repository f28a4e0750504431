"""DeepSeek-V3: published sizes counted as transformers does, HF logits and files both ways (the balancing bias
included), the bias moved by its load outside the optimizer, every layout against one process (the bias's move
included), and the layout checks."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # build from configs; nothing may download
transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors.torch")

from functitan import checkpoint as ckpt  # noqa: E402
from functitan.model import count, init  # noqa: E402
from models import deepseek_v3  # noqa: E402

M = deepseek_v3.MODEL
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
LOGITS_ATOL = 1e-5  # fp32; measured max |ours - HF| 1.4e-6 .. 2.0e-6 (logits up to 2.8), the three variants below


@pytest.mark.parametrize("flavor", ["16b", "671b"])
def test_published_sizes_count_exactly_as_transformers(flavor):
    cfg = M.config(flavor)
    hf_cfg = transformers.DeepseekV3Config(
        **{k: v for k, v in deepseek_v3.config_to_hf(cfg).items() if k != "model_type"}
    )
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_cfg)
    # transformers keeps e_score_correction_bias as a buffer; here it is a param (moe.bias), so both count it
    total = sum(p.numel() for p in hf.parameters())
    total += sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert count(M.params(cfg)) == total
    assert deepseek_v3.config_from_hf(hf_cfg.to_dict()) == cfg
    moe_layers = cfg.n_layers - cfg.first_k_dense
    idle = (cfg.experts - cfg.top_k) * 3 * cfg.dim * cfg.moe_ffn_dim * moe_layers
    assert deepseek_v3.active_params(cfg) == total - idle
    if flavor == "671b":  # DeepSeek-V3 without its MTP layer; 37B activated per the report
        assert total == 671_026_419_200
        assert deepseek_v3.active_params(cfg) == 37_552_297_472
    else:  # torchtitan's 16B (DeepSeek-V2-Lite's shape)
        assert total == 15_706_485_888
        assert deepseek_v3.active_params(cfg) == 2_661_151_872
    # FLOPs: 6 per active matmul param (the token table is a lookup) plus attention over qk and v widths
    table = cfg.vocab_size * cfg.dim
    attn = 6 * cfg.n_layers * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 4096
    assert deepseek_v3.flops_per_token(cfg, 4096) == 6 * (deepseek_v3.active_params(cfg) - table) + attn


def _hf_model(q_lora_rank, rope_interleave, seed=0):
    """A tiny random DeepseekV3ForCausalLM, every weight (norms too) and the balancing bias random; layer 0 of 3
    dense, 8 experts in 4 groups (2 kept), 3 per token, 2 shared, v_head_dim != qk_nope_head_dim."""
    config = transformers.DeepseekV3Config(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,  # MLA reads none; transformers' eager attention divides by it
        q_lora_rank=q_lora_rank,
        kv_lora_rank=20,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        rope_interleave=rope_interleave,
        max_position_embeddings=64,
        num_nextn_predict_layers=0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))  # moves the choice of many tokens
    return model


@pytest.mark.parametrize(
    "q_lora_rank, rope_interleave", [(24, True), (None, True), (24, False)], ids=["q_lora", "plain_q", "halves"]
)
def test_load_hf_logits_match_transformers_and_export_round_trips_byte_exact(tmp_path, q_lora_rank, rope_interleave):
    model = _hf_model(q_lora_rank, rope_interleave)
    model.save_pretrained(tmp_path / "src")
    cfg, params = ckpt.load_hf(tmp_path / "src", M)
    assert (cfg.q_lora_rank, cfg.rope_interleave, cfg.first_k_dense, cfg.n_shared_experts) == (
        q_lora_rank,
        rope_interleave,
        1,
        2,
    )
    assert "mlp" in params["layers"][0] and "moe" in params["layers"][1]
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(params["layers"][1]["moe"]["bias"], bias) and bias.abs().max() > 0
    with torch.no_grad():
        theirs = model(TOKENS).logits
    ours = M.apply(params, TOKENS, cfg)
    assert ours.shape == theirs.shape == (2, 20, 96)
    assert (ours - theirs).abs().max().item() < LOGITS_ATOL
    # the bias takes part: without it other experts are chosen and the logits move far beyond the tolerance
    unbiased = {**params, "layers": [dict(p) for p in params["layers"]]}
    for p in unbiased["layers"][1:]:
        p["moe"] = {**p["moe"], "bias": torch.zeros_like(p["moe"]["bias"])}
    assert (M.apply(unbiased, TOKENS, cfg) - theirs).abs().max().item() > 100 * LOGITS_ATOL
    ckpt.save_hf(params, M, cfg, tmp_path / "out")
    from safetensors.torch import load_file

    src, out = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(src) == sorted(out)  # one key per expert and matrix, and the two biases
    assert sum(k.endswith("e_score_correction_bias") for k in out) == 2
    for k in src:
        assert torch.equal(src[k], out[k]), k  # byte-exact
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, theirs)


def test_config_from_hf_refuses_what_is_not_implemented_by_key():
    d = deepseek_v3.config_to_hf(M.config("debug"))
    yarn = {**d, "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type='yarn' is not supported"):
        deepseek_v3.config_from_hf(yarn)
    with pytest.raises(ValueError, match=r"scoring_func='softmax' is not supported"):
        deepseek_v3.config_from_hf({**d, "scoring_func": "softmax"})
    assert deepseek_v3.config_from_hf(d) == M.config("debug", balance=0.0)  # balance is not an HF key


def test_the_balancing_bias_learns_each_layers_load_and_moves_by_the_rate_outside_the_optimizer(monkeypatch):
    from functitan import optim
    from functitan.model import specs
    from functitan.moe import LoadBalance, _layer
    from functitan.step import make_train_step
    from functitan.train_state import TrainState
    from functitan.transforms import value_and_grad

    cfg = M.config("debug", vocab_size=64)
    params = init(M.params(cfg), 0)
    for i, p in enumerate(params["layers"][1:]):  # nonzero, as a trained checkpoint's
        p["moe"]["bias"] = 0.1 * torch.randn(cfg.experts, generator=torch.Generator().manual_seed(i))
    moe_layers = [i for i, p in enumerate(params["layers"]) if "moe" in p]
    before = {i: params["layers"][i]["moe"]["bias"].clone() for i in moe_layers}
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    chosen: list[torch.Tensor] = []  # each MoE layer's choice, in order, recorded where the layer routes
    route = _layer.route
    monkeypatch.setattr(_layer, "route", lambda *a: (out := route(*a), chosen.append(out[1]))[0])
    grad_fn = value_and_grad(lambda p, b: M.loss(p, b, cfg)[0].sum)
    _, grads = grad_fn(params, batch)
    loads = {i: torch.bincount(c.flatten(), minlength=cfg.experts).float() for i, c in zip(moe_layers, chosen)}
    assert len(chosen) == len(moe_layers) and not torch.equal(loads[1], loads[2])
    for i in moe_layers:  # the gradient of the sum is the layer's assignments per expert, exactly
        assert torch.equal(grads["layers"][i]["moe"]["bias"], loads[i])
        assert loads[i].sum() == 64 * cfg.top_k
    # one trainer step: AdamW decaying every param (mask=None), so only the balance rule can keep the bias's value
    balance = LoadBalance.from_specs(specs(M.params(cfg)), 1e-3)
    assert balance.names == {"layers.1.moe.bias", "layers.2.moe.bias"}
    opt = optim.adamw(1e-2, weight_decay=0.1, mask=None)
    loss_fn = lambda p, b: M.loss(p, b, cfg)[0]  # noqa: E731  (a TokenLoss: the step divides by the tokens)
    step = make_train_step(value_and_grad(loss_fn), opt, max_norm=1e-3, balance=balance)
    chosen.clear()
    after, metrics = step(TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=0), batch)
    for i in moe_layers:
        load, mean = loads[i], loads[i].mean()
        move = 1e-3 * torch.sign(mean - load)
        assert move.abs().sum() > 0
        torch.testing.assert_close(after.params["layers"][i]["moe"]["bias"], before[i] + move - move.mean())
        router = after.params["layers"][i]["moe"]["router"]["weight"]
        assert not torch.equal(router, params["layers"][i]["moe"]["router"]["weight"])
    # the loads (64 and 56 a layer) are not in the gradient norm, which clipping at 1e-3 would otherwise scale
    no_bias = value_and_grad(loss_fn)(params, batch)[1]
    for i in moe_layers:
        no_bias["layers"][i]["moe"]["bias"].zero_()
    assert metrics["grad_norm"] == pytest.approx(float(optim.global_norm(no_bias)) / 64, rel=1e-5)
    biases = [after.params["layers"][i]["moe"]["bias"] for i in moe_layers]
    assert metrics["moe_bias_norm"] == pytest.approx(float(torch.cat(biases).norm()), rel=1e-6)
    # rate 0 keeps the biases as loaded, whatever the optimizer would do to them
    frozen = make_train_step(value_and_grad(loss_fn), opt, balance=LoadBalance(balance.names, 0.0))
    kept, _ = frozen(TrainState(step=0, params=params, opt_state=opt.init(params), data_state=None, rng=0), batch)
    for i in moe_layers:
        assert torch.equal(kept.params["layers"][i]["moe"]["bias"], before[i])


def test_layout_checks_name_what_does_not_split_before_step_1():
    from functitan._model_setup import check_model

    cfg = M.config("debug")
    kw = dict(pp=1, seq_len=16, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"parallelism.tp=3 does not divide model.n_heads=4, model.ffn_dim=128"):
        check_model(M, cfg, tp=3, **kw)
    with pytest.raises(ValueError, match=r"sequence parallelism with parallelism.tp=2 needs training.seq_len"):
        check_model(M, cfg, tp=2, **{**kw, "seq_len": 15, "sequence_parallel": True})
    check_model(M, cfg, tp=1, **{**kw, "pp": 2})  # its stages carry the MoE aux
    check_model(M, cfg, tp=2, ep=2, **{**kw, "sequence_parallel": True})  # the names check of every contraction
    check_model(M, cfg, tp=1, ep=4, cp=2, **kw)


# ---- every layout equals one process (gloo pool, fp32) -----------------------------------------------------------

# 2 steps of SGD at lr 1 (the second step routes with the updated router), the balance term in the loss; the
# declaration's zero bias is drawn normal(0.1) by gradcheck, so the bias moves the choice. Measured max
# |grad - one process| <= 1.2e-7 over every param of every layout, |loss - one process| <= 4.8e-7 (one ulp).
LAYOUTS = {
    2: ("ddp", "fsdp", "ep", "ep_tp", "cp", "tp", "tp_sp", "pp_1f1b"),
    4: ("fsdp_ep", "ep4", "hsdp_ep", "ep_tp_sp", "cp_ep", "ep4_cp_tp_sp", "pp_ep"),
}


def _gradcheck_ranks(layouts):
    from functitan.model import _gradcheck

    return _gradcheck._worker("models.deepseek_v3", "debug", {"vocab_size": 64}, layouts, 4, 16, 0, 2)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_every_layout_equals_one_process_losses_and_every_gradient(world, gloo):
    from functitan.model import _gradcheck

    wait = gloo.submit(_gradcheck_ranks, world, LAYOUTS[world])
    ref_losses, ref_grads, ref_change = _gradcheck._train(
        "models.deepseek_v3", "debug", {"vocab_size": 64}, None, 4, 16, 0, 2
    )
    from support import merged_ranks

    got = merged_ranks(wait())  # a pipeline rank holds its stages' params
    assert any(g.abs().max() > 0 for n, g in ref_grads.items() if "experts" in n)
    assert any(g.abs().max() > 0 for n, g in ref_grads.items() if "shared" in n)
    assert all(ref_change[n].abs().max() > 0 for n in ref_change if n.endswith("moe.bias"))  # moved by its load
    for lname in LAYOUTS[world]:
        losses, grads, change = got[lname]
        assert losses is not None, f"{lname}: {grads}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-6, rtol=0)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-6, rtol=0, msg=f"{lname} {name}")
            torch.testing.assert_close(change[name], ref_change[name], atol=1e-6, rtol=0, msg=f"{lname} {name}@2")


def test_cli_gradcheck_reports_nothing_under_fsdp_ep_and_tp():
    from support import cli

    out = cli(
        "gradcheck", "--model.name=models.deepseek_v3", "--model.vocab_size=64", "--layouts=fsdp,ep,tp", "--steps=2"
    )
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.split()}
    assert [lines[n].split()[1:] for n in ("fsdp", "ep", "tp")] == [["ok"]] * 3, out.stdout


# ---- the trainer: full remat under ep, and a checkpoint that carries the biases across an ep change ------------

RESUME = {"checkpoint.enable": True, "checkpoint.interval": 3, "checkpoint.keep_last": 2, "training.steps": 5}


def _train(layout: dict, run_dir: str, name: str):
    from support import SMALL, train_small

    base = {k: v for k, v in SMALL.items() if not k.startswith("model.")}
    over = {"model.name": "deepseek_v3", "model.flavor": "debug", **RESUME, **layout}
    losses, params, _ = train_small({**over, "metrics.run_dir": run_dir, "metrics.run_name": name}, base)
    return losses, params


def _ep4_full_remat_then_ep2(root: str):
    """fsdp 4 x ep 4 with full remat for 5 steps; the same run cut after step 3 and resumed as fsdp 4 x ep 2."""
    import contextlib
    import shutil

    from support import Crash, crashing_at_step

    ep4 = {"parallelism.dp_shard": 4, "parallelism.ep": 4, "training.remat": "full"}
    straight = _train(ep4, root, "straight")
    with crashing_at_step(3), contextlib.suppress(Crash):
        _train(ep4, root, "cut")
    if torch.distributed.get_rank() == 0:
        shutil.copytree(f"{root}/cut", f"{root}/ep2")
    torch.distributed.barrier()
    return straight, _train({"parallelism.dp_shard": 4, "parallelism.ep": 2}, root, "ep2")


def test_full_remat_under_ep4_equals_one_process_and_its_checkpoint_resumes_at_ep2_biases_included(tmp_path, gloo):
    wait = gloo.submit(_ep4_full_remat_then_ep2, 4, str(tmp_path), timeout=280)
    ref_losses, ref_params = _train({}, str(tmp_path), "ref")  # one process, no remat
    (straight, resumed) = wait()[0]
    torch.testing.assert_close(torch.tensor(straight[0]), torch.tensor(ref_losses), atol=2e-5, rtol=1e-4)
    biases = [k for k in ref_params if k.endswith("moe.bias")]
    assert len(biases) == 2 and all(ref_params[k].abs().max() > 0 for k in biases)  # moved by their loads
    for k, p in straight[1].items():
        torch.testing.assert_close(p, ref_params[k], atol=1e-4, rtol=1e-3, msg=k)
    losses, params = resumed
    assert len(losses) == 5  # steps 1-3 of the cut run, then 4 and 5 from its checkpoint
    torch.testing.assert_close(torch.tensor(losses[-2:]), torch.tensor(straight[0][-2:]), atol=2e-5, rtol=1e-4)
    for k, p in params.items():  # the biases as the straight run moved them: restored, then moved the same way
        torch.testing.assert_close(p, straight[1][k], atol=1e-4, rtol=1e-3, msg=k)
