"""The GPU check runs once per lent GPU (15 minutes of device time): its CPU dry run keeps it working."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_measures_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out), "--profile", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] and set(result["shapes"]) == {"1b", "8b"} and not result["skipped"]
    assert result["gemm_peak"]["median_flops"] > 0
    attention = result["attention"]["seqs"]  # the kernel SDPA chose for each case, at each sequence length
    assert set(attention) == {"64", "128"}, attention
    for row in attention.values():
        assert row["causal"]["kernel"] in ("flash", "efficient", "cudnn", "math") and row["causal"]["median_s"] > 0
        assert "error" not in row["documents"] and row["documents"]["ops"], row
    for name, shape in result["shapes"].items():
        assert "error" not in shape and "error" not in shape["checkpoint"], name
        assert set(shape["median_step_s"]) == {"functitan", "torch", "torch_fused"}
        assert shape["ratio"] > 0 and shape["ratio_vs_torch_fused_adamw"] > 0  # tiny CPU shapes: no target
        assert shape["checkpoint"]["bytes"] > 0 and shape["checkpoint"]["reuse_blocked_s"] >= 0
        assert (tmp_path / f"profile_{name}_functitan.txt").read_text().count("aten::mm") >= 1
    loop = result["shapes"]["1b"]["checkpoint_loop"]  # the trainer's save path, for the first shape only
    assert "error" not in loop and len(loop["lost_s"]) == 2 and min(loop["steps_in_flight"]) >= 1
    assert loop["sync_save_s"][0] > 0 and "checkpoint_loop" not in result["shapes"]["8b"]
    trainer = result["trainer"]  # the CLI as typed, then a run resumed from its half-way checkpoint
    assert "error" not in trainer, trainer["error"]
    assert trainer["resumed_steps"] == [3, 4] and trainer["resume_max_abs_loss_diff"] == 0.0
    assert trainer["last_loss"] < trainer["first_loss"]
