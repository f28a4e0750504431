"""Print the storage placements that each parallel layout gives a few Llama params (used in docs/parallelism.md).

Params live on ``storage_mesh(mesh)``, the mesh's axes of more than one rank; each is shown with its placement.

python examples/print_layouts.py
"""

from __future__ import annotations

from functitan.mesh import AXES, make_mesh, storage_mesh
from functitan.sharding import default_rules, spec_placements
from functitan.testing import run_distributed
from models import llama

LAYOUTS = {
    "DDP 4": dict(dp_replicate=4, dp_shard=1),
    "FSDP 4": dict(dp_shard=4),
    "HSDP 2x2": dict(dp_replicate=2, dp_shard=2),
    "FSDP 2 x TP 2": dict(dp_shard=2, tp=2),
    "TP 4 + SP": dict(dp_shard=1, tp=4),
    "CP 2 x TP 2": dict(dp_shard=1, cp=2, tp=2),
}
PARAMS = ("embed.weight", "layers.0.attn.wq", "layers.0.attn.wo", "layers.0.mlp.w_gate", "layers.0.attn_norm.weight")


def _placements(degrees: dict) -> dict[str, str]:
    mesh = make_mesh(**degrees)
    specs = llama.specs(llama.CONFIGS["debug"])
    layer = specs["layers"][0]
    spec_of = {
        "embed.weight": specs["embed"]["weight"],
        "layers.0.attn.wq": layer["attn"]["wq"],
        "layers.0.attn.wo": layer["attn"]["wo"],
        "layers.0.mlp.w_gate": layer["mlp"]["w_gate"],
        "layers.0.attn_norm.weight": layer["attn_norm"]["weight"],
    }
    rules = default_rules(sequence_parallel=degrees.get("tp", 1) > 1)
    kept = storage_mesh(mesh).mesh_dim_names or ()

    def shown(spec: tuple) -> str:
        pl = dict(zip(AXES, spec_placements(spec, rules, mesh), strict=True))
        return "(" + ", ".join(f"{a}={pl[a]!r}" for a in kept) + ")"

    return {n: shown(spec_of[n]) for n in PARAMS}


def _every_layout() -> dict[str, dict[str, str]]:
    """All layouts in one group of 4 processes (one launch, not one per layout)."""
    return {name: _placements(degrees) for name, degrees in LAYOUTS.items()}


def main() -> None:
    print(f"mesh axes: ({', '.join(AXES)})")
    for name, placements in run_distributed(_every_layout, 4)[0].items():
        print(f"\n{name}  {LAYOUTS[name]}")
        for param, pl in placements.items():
            print(f"  {param:<28} {pl}")


if __name__ == "__main__":
    main()
