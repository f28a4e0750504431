"""The trainer starts from a Hugging Face directory, and its checkpoints export to one that transformers loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import train_small

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _hf_dir(path):
    cfg = transformers.LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def test_train_from_hf_then_export_and_load_in_transformers(tmp_path, gloo):
    os.environ["HF_HUB_OFFLINE"] = "1"
    _hf_dir(tmp_path / "hf")
    common = {
        "metrics.run_dir": str(tmp_path),
        "training.steps": 2,
        "checkpoint.enable": True,
        "checkpoint.interval": 2,
    }
    from_hf = gloo.run(
        train_small, 1, {**common, "checkpoint.load_path": str(tmp_path / "hf"), "metrics.run_name": "a"}
    )[0]
    # import the same directory as a functitan checkpoint and start from that: the same run
    subprocess.run(
        [sys.executable, "-m", "functitan.cli", "import", "hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")],
        check=True,
        cwd=ROOT,
    )
    from_ckpt = gloo.run(
        train_small,
        1,
        {
            **common,
            "checkpoint.load_path": str(tmp_path / "ckpt"),
            "metrics.run_name": "b",
            "model.dim": 64,
            "model.n_layers": 2,
            "model.n_heads": 8,
            "model.n_kv_heads": 4,
            "model.ffn_dim": 128,
        },
    )[0]
    scratch = gloo.run(
        train_small,
        1,
        {
            **common,
            "metrics.run_name": "c",
            "model.dim": 64,
            "model.n_layers": 2,
            "model.n_heads": 8,
            "model.n_kv_heads": 4,
            "model.ffn_dim": 128,
        },
    )[0]
    assert from_hf[0] == from_ckpt[0] and from_hf[0][0] != scratch[0][0]
    # export the trainer's step-2 checkpoint and load it with transformers
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "functitan.cli",
            "export",
            "hf",
            str(tmp_path / "a" / "checkpoints" / "2"),
            str(tmp_path / "exported"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported")
    torch.testing.assert_close(
        model.model.layers[1].mlp.down_proj.weight.detach(), from_hf[1]["layers.1.mlp.w_down"], atol=0, rtol=0
    )
