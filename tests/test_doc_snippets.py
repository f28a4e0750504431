"""The ```python blocks of README.md and docs/*.md run as typed (or, where one needs more processes than a test
affords, with one named substitution), so a guide never shows an API that does not exist."""

from __future__ import annotations

import ast
import builtins
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from functitan.train_state import TrainState
from functitan.tree import flatten_with_names

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# every block, and how it is checked: a new block without an entry here fails test_every_block_is_checked
CHECKED = {
    ("checkpoints.md", 0): "run twice: saves, then resumes bit for bit",
    ("pipeline.md", 0): "run on 2 processes with dp_shard=1",
    ("models.md", 0): "fragment: Model's fields",
    ("models.md", 1): "fragment: a dict entry of Params",
    ("models.md", 2): "run as a script on tests/assets/tiny_gpt.py, fsdp only",
    ("models.md", 3): "run in tests/test_objectives.py: the masked-LM loss against F.cross_entropy",
    ("moe.md", 0): "run as typed: the layer's output shape and the experts' shares",
}


def blocks() -> dict[tuple[str, int], str]:
    out = {}
    for page in PAGES:
        found = re.findall(r"^```python\n(.*?)^```$", page.read_text(encoding="utf-8"), re.S | re.M)
        out.update({(page.name, i): code for i, code in enumerate(found)})
    return out


def block(page: str, index: int) -> str:
    return blocks()[page, index]


def undefined_names(code: str) -> set[str]:
    """Names a block reads but neither imports, assigns nor defines (nor are builtins)."""
    tree = ast.parse(code)
    defined = set(dir(builtins)) | {"__name__"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined


def test_every_block_is_checked():
    assert set(blocks()) == set(CHECKED)


def test_every_runnable_block_imports_or_defines_every_name_it_uses():
    for where, code in blocks().items():
        if not CHECKED[where].startswith("fragment"):
            assert not undefined_names(code), f"{where}: {sorted(undefined_names(code))} not imported or defined"


def test_the_fragments_name_what_exists():
    from functitan import model

    call = ast.parse(block("models.md", 0)).body[0].value
    assert call.func.id == "Model" and {k.arg for k in call.keywords} <= set(model.Model.__dataclass_fields__)
    entry = ast.parse("{" + block("models.md", 1) + "}")  # a dict entry: wrapped, it parses
    calls = {n.func.id for n in ast.walk(entry) if isinstance(n, ast.Call)}
    assert calls == {"Param", "normal", "zeros"} and all(hasattr(model, c) for c in calls)


def test_the_checkpoint_loop_saves_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    code = block("checkpoints.md", 0)
    monkeypatch.chdir(tmp_path)
    first: dict = {"__name__": "__doc__"}
    exec(code, first)
    assert first["restored"] is None and first["state"].step == 12
    root = tmp_path / "runs/demo/checkpoints"
    assert sorted(int(p.name) for p in root.iterdir()) == [4, 8, 12]
    shutil.rmtree(root / "12")  # the run stopped after step 8's save: run again, resume there, redo 4 steps
    again: dict = {"__name__": "__doc__"}
    exec(code, again)
    assert again["restored"].step == 8 and again["state"].step == 12
    assert again["state"].data_state == first["state"].data_state
    got, want = (flatten_with_names(ns["state"].params)[0] for ns in (again, first))
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a.detach(), b.detach()) for (_, a), (_, b) in zip(got, want))


def _run_pipeline_block(code: str) -> float:
    ns: dict = {"__name__": "__doc__"}
    exec(code, ns)
    cfg, params = ns["cfg"], ns["params"]
    tokens = torch.randint(0, cfg.vocab_size, (8, 257), generator=torch.Generator().manual_seed(0))
    state = TrainState(step=0, params=params, opt_state=ns["opt"].init(params), data_state=None, rng=0)
    state, metrics = ns["train_step"](state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    assert state.step == 1
    return metrics["loss"]


def test_the_pipeline_block_trains_a_step(gloo):
    code = block("pipeline.md", 0)
    assert code.count("dp_shard=2") == 1
    losses = gloo.run(_run_pipeline_block, 2, code.replace("dp_shard=2", "dp_shard=1"), timeout=300)
    assert losses[0] == losses[1] and 5.0 < losses[0] < 6.0  # about log(258): a fresh model on byte tokens


def test_the_gradcheck_block_runs_as_a_script(tmp_path):
    code = block("models.md", 2)
    layouts = '("fsdp", "hsdp", "tp", "tp_sp", "fsdp_tp_sp")'
    assert code.count("path/to/my_model.py") == 1 and code.count(layouts) == 1
    script = tmp_path / "check.py"
    script.write_text(
        code.replace("path/to/my_model.py", str(ROOT / "tests/assets/tiny_gpt.py")).replace(layouts, '("fsdp",)')
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "{'fsdp': {}}"


def test_the_moe_guide_runs_as_typed():
    scope: dict = {}
    exec(compile(block("moe.md", 0), "docs/moe.md", "exec"), scope)
    assert scope["x"].shape == (2, 16, 64)
    assert torch.allclose(scope["share"].sum(), torch.tensor(1.0)) and scope["share"].shape == (8,)
    assert scope["aux"]["balance"].shape == (2,)  # one balance term per sequence
