"""torch DCP, torchtitan's checkpoint format, on the checkpoint format seam: written on the commit protocol by any
number of ranks, read into any placement, loaded by the trainer from torchtitan's names, exported to them."""

import os
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import cli, train_small

from functitan.checkpoint import Checkpointer, DcpFormat, read_dcp, save_hf
from functitan.random import key
from functitan.tree import flatten_with_names
from models import llama

# the SMALL run's model (tests/support.py): 8 heads, 4 kv heads of head_dim 8
CFG = llama.config("debug", vocab_size=258, n_layers=2, dim=64, n_heads=8, n_kv_heads=4, ffn_dim=128)


def _load(sd: dict, path: str) -> None:
    """``dcp.load`` in this (non-distributed) process, as a reader of torchtitan checkpoints calls it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=path, no_dist=True)


def _meta_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q/k rows -> Meta's (torchtitan's), written as torchtitan's Llama3StateDictAdapter._reverse_permute is."""
    d1, d2 = w.shape
    return w.view(heads, 2, d1 // heads // 2, d2).transpose(1, 2).reshape(d1, d2)


def _torchtitan_state(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full params (dotted names) in torchtitan 0.3's Llama 3 state-dict names, by a table written here."""
    sd = {
        "tok_embeddings.weight": params["embed.weight"],
        "norm.weight": params["norm.weight"],
        "lm_head.weight": params["output.weight"],
    }
    for i in range(CFG.n_layers):
        p, t = f"layers.{i}.", f"layers.{i}."
        sd[t + "attention.qkv_linear.wq.weight"] = _meta_rows(params[p + "attn.wq"], CFG.n_heads)
        sd[t + "attention.qkv_linear.wk.weight"] = _meta_rows(params[p + "attn.wk"], CFG.kv_heads)
        sd[t + "attention.qkv_linear.wv.weight"] = params[p + "attn.wv"]
        sd[t + "attention.wo.weight"] = params[p + "attn.wo"]
        sd[t + "attention_norm.weight"] = params[p + "attn_norm.weight"]
        sd[t + "ffn_norm.weight"] = params[p + "mlp_norm.weight"]
        sd[t + "feed_forward.w1.weight"] = params[p + "mlp.w_gate"]
        sd[t + "feed_forward.w3.weight"] = params[p + "mlp.w_up"]
        sd[t + "feed_forward.w2.weight"] = params[p + "mlp.w_down"]
    return {k: v.contiguous() for k, v in sd.items()}


def _save_as_torchtitan(state: dict[str, torch.Tensor], path: str) -> None:
    """On every rank: ``dcp.save`` of FSDP-sharded DTensors in torchtitan's names, plus the optimizer, scheduler and
    train-state entries a full torchtitan step holds (which a weights-only load skips)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in state.items()}
    first = next(iter(sd))
    sd[f"optimizer.state.{first}.exp_avg"] = distribute_tensor(torch.zeros_like(state[first]), mesh, [Shard(0)])
    sd["lr_scheduler.last_epoch"] = 2
    sd["train_state.step"] = torch.tensor(2)
    dcp.save(sd, checkpoint_id=path)


def _save_tree_with_dcp_format(path: str):
    """Every rank saves the same tree through the commit protocol in DCP: a Shard(0) and a Shard(1) leaf, a
    replicated one, a bf16 one and a scalar."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(0)
    full = {
        "rows": torch.randn(6, 4, generator=g),
        "cols": torch.randn(3, 8, generator=g),
        "rep": torch.randn(5, generator=g),
    }
    tree = {
        "params": {
            "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        },
        "half": full["rows"].to(torch.bfloat16),
        "step": 7,
    }
    with Checkpointer(format=DcpFormat()) as ck:
        ck.save_sync(path, tree)
    # read back into another placement: rows as Shard(1), cols whole
    back = read_dcp(
        path,
        {
            "params": {
                "rows": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)]),
                "cols": torch.zeros(3, 8),
                "rep": distribute_tensor(torch.zeros(5), mesh, [Replicate()]),
            },
            "half": torch.zeros(6, 4, dtype=torch.bfloat16),
            "step": 0,
        },
    )
    return {
        "rows_local": back["params"]["rows"].to_local().clone(),
        "cols": back["params"]["cols"],
        "rep": back["params"]["rep"].to_local().clone(),
        "half": back["half"],
        "step": back["step"],
    }


def test_dcp_format_on_two_ranks_is_what_dcp_load_reads_and_reads_back_resharded(tmp_path, gloo):
    path = str(tmp_path / "ckpt")
    out = gloo.run(_save_tree_with_dcp_format, 2, path)
    g = torch.Generator().manual_seed(0)
    rows, cols, rep = torch.randn(6, 4, generator=g), torch.randn(3, 8, generator=g), torch.randn(5, generator=g)
    # the files of a DCP checkpoint (one per writing rank) plus the commit marker
    assert sorted(os.listdir(path)) == [".metadata", "_COMMIT", "__0_0.distcp", "__1_0.distcp"]
    sd = {
        "params.rows": torch.zeros(6, 4),
        "params.cols": torch.zeros(3, 8),
        "params.rep": torch.zeros(5),
        "half": torch.zeros(6, 4, dtype=torch.bfloat16),
        "step": torch.tensor(0),
    }
    _load(sd, path)
    assert torch.equal(sd["params.rows"], rows) and torch.equal(sd["params.cols"], cols)
    assert torch.equal(sd["params.rep"], rep) and torch.equal(sd["half"], rows.to(torch.bfloat16))
    assert sd["step"].item() == 7
    md = dcp.FileSystemReader(path).read_metadata()
    assert len(md.state_dict_metadata["params.rep"].chunks) == 1  # a replica is written once
    assert len(md.state_dict_metadata["params.cols"].chunks) == 2  # one block per rank, along dim 1
    for rank, got in enumerate(out):
        assert torch.equal(got["rows_local"], rows[:, 2 * rank : 2 * rank + 2])
        assert torch.equal(got["cols"], cols) and torch.equal(got["rep"], rep)
        assert torch.equal(got["half"], rows.to(torch.bfloat16)) and got["step"] == 7


def test_a_torchtitan_checkpoint_trains_as_the_same_weights_from_hf_and_exports_back(tmp_path, gloo):
    """Issue 26's acceptance: torchtitan's DCP (dcp.save from 2 FSDP ranks, Meta's rotary rows, optimizer entries
    beside the model's) starts the same run at FSDP 2 as the same weights in an HF directory; ``export dcp`` of the
    run's checkpoint is read by ``dcp.load`` into torchtitan's names."""
    tree = llama.init(CFG, key(3))
    params = dict(flatten_with_names(tree)[0])
    gloo.run(_save_as_torchtitan, 2, _torchtitan_state(params), str(tmp_path / "step-2"))
    save_hf(tree, llama.MODEL, CFG, tmp_path / "hf")
    common = {"metrics.run_dir": str(tmp_path), "training.steps": 2, "parallelism.dp_shard": 2}
    flags = {f"model.{k}": getattr(CFG, k) for k in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim")}
    dcp_run = {**flags, "checkpoint.load_path": str(tmp_path / "step-2"), "checkpoint.enable": True}
    runs = {
        name: gloo.run(train_small, 2, {**common, **extra, "metrics.run_name": name})[0]
        for name, extra in {"from_dcp": dcp_run, "from_hf": {"checkpoint.load_path": str(tmp_path / "hf")}}.items()
    }
    assert runs["from_dcp"][0] == runs["from_hf"][0]  # every step's loss, the first one before any update
    scratch = train_small({**common, **flags, "parallelism.dp_shard": 1, "training.steps": 1})[0]
    assert runs["from_dcp"][0][0] != scratch[0]  # the load took: a fresh init starts elsewhere
    out = cli("export", "dcp", str(tmp_path / "from_dcp" / "checkpoints" / "2"), str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    want = _torchtitan_state(runs["from_dcp"][1])  # the run's weights after its 2 steps
    sd = {k: torch.zeros_like(v) for k, v in want.items()}
    _load(sd, str(tmp_path / "out"))
    assert sorted(sd) == sorted(dcp.FileSystemReader(str(tmp_path / "out")).read_metadata().state_dict_metadata)
    for k, v in want.items():
        assert torch.equal(sd[k], v), k


def test_torchtitan_itself_reads_the_export_and_its_checkpoint_gives_our_loss(tmp_path):
    """With torchtitan installed (not in CI: it needs triton): its Llama 3 debugmodel, saved as its checkpointer
    saves a model (``dcp.save`` of the flat model state dict), gives the same loss in functitan on the same tokens;
    and torchtitan's model loads ``export_dcp``'s output (``dcp.load`` into its own state dict) to our logits."""
    tt = pytest.importorskip("torchtitan.models.llama3", exc_type=ImportError)
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from functitan.checkpoint import export_dcp, read_dcp, save
    from functitan.checkpoint._hf import write_model_config
    from functitan.model import init

    torch.manual_seed(0)
    model = tt.llama3_configs["debugmodel"](attn_backend="flex").build()
    for block in model.layers.values():  # flex attention has no CPU backward; forward is all this needs, causal
        block.attention.inner_attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "step-10"), no_dist=True)
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    cfg = llama.config("debug", vocab_size=2048, dim=256, n_layers=6, n_heads=16, n_kv_heads=None, ffn_dim=768)
    cfg = replace(cfg, rope_scaling=llama.RopeScaling(), rope_theta=500000.0, norm_eps=1e-5)
    exemplar = init(llama.params(cfg), 0)
    params = read_dcp(str(tmp_path / "step-10"), exemplar, llama.MODEL.torchtitan(cfg), cast=True)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    with torch.no_grad():
        ours = llama.loss(params, batch, cfg)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    # back: our weights (the final norm halved, so not what torchtitan holds) exported, loaded by torchtitan's model
    halved = {**params, "norm": {"weight": params["norm"]["weight"] * 0.5}}
    save(tmp_path / "ours", {"params": halved}).wait()
    write_model_config("llama", cfg, tmp_path / "ours")
    export_dcp(tmp_path / "ours", tmp_path / "export")
    sd = model.state_dict()
    _load(sd, str(tmp_path / "export"))
    model.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens[:, :-1]), llama.apply(halved, tokens[:, :-1], cfg), atol=2e-5, rtol=2e-5
        )


def _tiny_dcp(path, cfg=CFG) -> None:
    """A torchtitan-named DCP of a fresh ``cfg`` Llama, from this process."""
    params = dict(flatten_with_names(llama.init(cfg, key(0)))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_torchtitan_state(params), checkpoint_id=str(path), no_dist=True)


def test_dcp_load_errors_name_the_key_and_the_fix(tmp_path):
    from functitan.checkpoint import CheckpointError, restore_params
    from functitan.model import init

    _tiny_dcp(tmp_path / "step-1")
    wider = replace(CFG, ffn_dim=256)
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.mlp\.w_down: the checkpoint holds shape \(64, 128\) .*w2\.weight.*the exemplar \(64, 256\)",
    ):
        restore_params(tmp_path / "step-1", init(llama.params(wider), 0), model=(llama.MODEL, wider))
    deeper = replace(CFG, n_layers=3)
    with pytest.raises(
        CheckpointError,
        match=r"layers\.2\.attention\.qkv_linear\.wk\.weight \(for layers\.2\.attn\.wk\): not in the DCP .*9 keys missing",
    ):
        restore_params(tmp_path / "step-1", init(llama.params(deeper), 0), model=(llama.MODEL, deeper))
    (tmp_path / "cut").mkdir()
    data = (tmp_path / "step-1" / ".metadata").read_bytes()
    (tmp_path / "cut" / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut/\.metadata cannot be read as DCP metadata"):
        restore_params(tmp_path / "cut", init(llama.params(CFG), 0), model=(llama.MODEL, CFG))


def test_export_dcp_bad_input_is_one_line_exit_2(tmp_path):
    from functitan.checkpoint import save_sync
    from functitan.checkpoint._hf import write_model_config
    from functitan.model import init
    from models import gpt2

    cfg = gpt2.MODEL.config("debug", n_layers=1, dim=32, n_heads=2)
    save_sync(tmp_path / "gpt2", {"params": init(gpt2.MODEL.params(cfg), 0)})
    write_model_config("gpt2", cfg, tmp_path / "gpt2")
    (tmp_path / "taken").mkdir()
    cases = {
        ("gpt2", "out"): "model 'gpt2' declares no torchtitan key map (Model.torchtitan)",
        ("gpt2", "taken"): "already exists; pass a new directory",
        ("nowhere", "out"): "checkpoint {tmp}/nowhere does not exist",
    }
    for (src, dst), message in cases.items():
        out = cli("export", "dcp", str(tmp_path / src), str(tmp_path / dst))
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert message.format(tmp=tmp_path) in out.stderr and out.stderr.startswith("functitan: error:"), out.stderr
    assert not (tmp_path / "out").exists()
