"""Plan a model's parallel layout for this machine, then train the recommended config.

    python examples/plan_then_train.py            # 2 CPU processes, a small Llama, 20 steps

1. ``functitan.plan.plan`` enumerates every layout of 2 processes (FSDP, DDP, HSDP, TP+SP, PP schedules,
   microbatches, remat), traces the trainer's own step of the best candidates on meta tensors to get
   each rank's peak memory and collective bytes, and ranks them by predicted step time.
2. ``write_toml`` writes the recommendation as a config; ``functitan train --config plan.toml`` runs it as is.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from functitan.plan import Cluster, device, plan, table, write_toml

WORLD = 2
MODEL = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384}


def main() -> None:
    cluster = Cluster(device=device("cpu"), nodes=1, per_node=WORLD)
    result = plan(
        model_name="llama",
        flavor="debug",
        overrides=MODEL,
        cluster=cluster,
        global_batch_tokens=8 * 128,
        seq_len=128,
        top=3,
    )
    print(table(result, cluster.device.usable))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.toml"
        write_toml(result.cfg, path)
        print(path.read_text())
        cmd = [
            sys.executable,
            "-m",
            "functitan.train",
            "--config",
            str(path),
            "--training.steps=20",
            "--metrics.log_every=10",
            f"--metrics.run_dir={d}",
            "--nproc",
            str(WORLD),
        ]
        print("$", " ".join(cmd[1:]))
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
