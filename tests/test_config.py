"""Config files and overrides land on frozen dataclasses; bad keys and values name the key and the fix."""

from pathlib import Path

import pytest
from support import cli

from functitan.config import ConfigError, config_help, flat_keys, parse_config
from functitan.job_config import JobConfig

ROOT = Path(__file__).resolve().parents[1]


def test_toml_then_overrides_in_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1e-3\n[data]\npaths = ["a.txt", "b.jsonl"]\n')
    cfg = parse_config(
        JobConfig, ["--config", str(f), "--training.steps=9", "--parallelism.dp_shard", "2", "--metrics.run_name=none"]
    )
    assert cfg.training.steps == 9 and cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 1e-3 and cfg.parallelism.dp_shard == 2
    assert cfg.data.paths == ("a.txt", "b.jsonl")
    assert cfg.metrics.run_name is None
    assert parse_config(JobConfig, ["--data.paths=x.txt,y.txt"]).data.paths == ("x.txt", "y.txt")


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'training.step' \(command line\); did you mean 'training.steps'\?"
    ):
        parse_config(JobConfig, ["--training.step=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lr'.*did you mean 'optimizer.lr'\?"):
        parse_config(JobConfig, ["--optim.lr=3"])


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"training.steps='ten' is not a valid int"):
        parse_config(JobConfig, ["--training.steps=ten"])
    with pytest.raises(
        ConfigError,
        match=r"training.remat='some' is not allowed; choose one of \['none', 'full', 'selective', 'offload'\]",
    ):
        parse_config(JobConfig, ["--training.remat=some"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps=1")
    with pytest.raises(ConfigError, match=r"bad.toml' is not valid TOML"):
        parse_config(JobConfig, ["--config", str(bad)])
    with pytest.raises(ConfigError, match=r"config file '.*missing.toml' does not exist"):
        parse_config(JobConfig, ["--config", str(tmp_path / "missing.toml")])


def test_help_lists_every_key_with_its_default():
    text = config_help(JobConfig)
    for key, (_, _default, _) in flat_keys(JobConfig).items():
        assert f"--{key}" in text
    assert "--training.steps" in text and "default: 200" in text
    assert "--parallelism.dp_shard" in text and "default: -1" in text


def test_help_says_what_each_key_is_in_its_sections_words():
    # a key's help is written once: its field's metadata, or its section's Attributes docstring
    lines = {line.split()[0]: line for line in config_help(JobConfig).splitlines() if line.startswith("  --")}
    assert lines["--training.seq_len"].endswith("tokens per sequence.")
    assert lines["--elastic.lighthouse"].endswith("the torchft lighthouse, http://HOST:PORT (live only).")
    assert lines["--data.tokenizer"].endswith(
        "a tokenizer.json or tiktoken file; None for the byte tokenizer (with path: None for the one the shards "
        "were made with, else it must be that one)."
    )


def test_cli_surface_is_frozen():
    # adding a key is fine (update this list); renaming or removing one breaks users' TOML files
    assert list(flat_keys(JobConfig)) == [
        "model.name",
        "model.flavor",
        "data.paths",
        "data.path",
        "data.tokenizer",
        "data.text_key",
        "data.add_bos",
        "data.seed",
        "data.max_corpus_bytes",
        "data.max_open_shards",
        "training.steps",
        "training.batch_size",
        "training.seq_len",
        "training.microbatches",
        "training.seed",
        "training.remat",
        "training.param_dtype",
        "training.reduce_dtype",
        "training.compile",
        "training.on_nonfinite",
        "training.device",
        "training.threads",
        "optimizer.name",
        "optimizer.lr",
        "optimizer.schedule",
        "optimizer.warmup_steps",
        "optimizer.final_lr_ratio",
        "optimizer.decay_fraction",
        "optimizer.b1",
        "optimizer.b2",
        "optimizer.eps",
        "optimizer.weight_decay",
        "optimizer.momentum",
        "optimizer.max_norm",
        "optimizer.muon_momentum",
        "optimizer.ns_steps",
        "optimizer.muon_adjust_lr",
        "optimizer.muon_ns_dtype",
        "optimizer.moe_bias_rate",
        "parallelism.dp_replicate",
        "parallelism.dp_shard",
        "parallelism.tp",
        "parallelism.pp",
        "parallelism.cp",
        "parallelism.ep",
        "parallelism.cp_attention",
        "parallelism.sequence_parallel",
        "parallelism.reshard_after_forward",
        "parallelism.pipeline_schedule",
        "parallelism.stages_per_rank",
        "metrics.log_every",
        "metrics.run_dir",
        "metrics.run_name",
        "metrics.wandb",
        "metrics.wandb_project",
        "metrics.wandb_entity",
        "metrics.wandb_mode",
        "checkpoint.enable",
        "checkpoint.folder",
        "checkpoint.interval",
        "checkpoint.keep_last",
        "checkpoint.load_path",
        "checkpoint.when_busy",
        "elastic.microbatch_size",
        "elastic.live",
        "elastic.lighthouse",
        "elastic.replica_id",
        "elastic.min_replicas",
        "elastic.timeout_s",
        "elastic.quorum_timeout_s",
        "elastic.advertise_host",
        "eval.every",
        "eval.batches",
        "eval.holdout",
        "eval.paths",
        "eval.path",
        "profile.steps",
        "profile.with_stack",
        "profile.memory_snapshot_steps",
        "profile.memory_snapshot_on_oom",
    ]


def test_train_help_and_bad_key_from_the_command_line():
    out = cli("train", "--help")
    assert out.returncode == 0 and "--optimizer.lr" in out.stdout
    bad = cli("train", "--trainig.steps=1")
    assert bad.returncode == 2 and "did you mean 'training.steps'?" in bad.stderr


def test_bundled_config_parses():
    cfg = parse_config(JobConfig, ["--config", str(ROOT / "configs" / "debug.toml")])
    assert cfg.model.flavor == "debug" and cfg.training.steps >= 200


LIVE = ["--elastic.live=true", "--elastic.microbatch_size=2", "--elastic.lighthouse=http://127.0.0.1:29510"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--elastic.live=true", "--elastic.lighthouse=http://h:1"], "elastic.microbatch_size=0: live=true needs >= 1"),
        (LIVE[:2], "elastic.lighthouse='': live=true needs the torchft lighthouse as http://HOST:PORT"),
        ([*LIVE[:2], "--elastic.lighthouse=h:1"], "elastic.lighthouse='h:1': live=true needs"),
        ([*LIVE, "--elastic.quorum_timeout_s=0"], "elastic.quorum_timeout_s=0.0: must be > 0 seconds"),
        ([*LIVE, "--elastic.min_replicas=0"], "elastic.min_replicas=0: must be >= 1"),
        (
            [*LIVE, "--parallelism.pp=2"],
            "elastic.live=true with parallelism.pp=2 is not supported; use parallelism.pp=1",
        ),
        ([*LIVE, "--training.batch_size=9"], "training.batch_size=9 must be a multiple of elastic.microbatch_size=2"),
        (["--elastic.microbatch_size=-1"], "elastic.microbatch_size=-1: must be >= 0"),
    ],
)
def test_the_live_levels_needs_are_checked_when_the_config_is_parsed(argv, message):
    # they were checked by the live stepper after the process group and the model were up, on every rank
    with pytest.raises(ConfigError) as exc:
        parse_config(JobConfig, argv)
    assert message in str(exc.value), str(exc.value)
    assert parse_config(JobConfig, [*LIVE, "--training.batch_size=8"]).elastic.live


def _three_updates(tx, params):
    import torch

    from functitan import optim

    state = tx.init(params)
    for i in range(3):
        grads = {k: torch.sin(v * (i + 1)) for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("name", ["lion", "adafactor"])
def test_every_shipped_optimizer_is_one_config_key_away(name):
    # only adamw and sgd could be chosen; lion and adafactor shipped in functitan.optim unreachable from a config
    import torch

    from functitan import optim
    from functitan.job_config import OptimizerConfig, build_optimizer, learning_rate_schedule

    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.05, b1=0.8, b2=0.97, warmup_steps=2)
    lr = learning_rate_schedule(cfg, 10)
    by_hand = {
        "lion": optim.lion(lr, b1=0.8, b2=0.97, weight_decay=0.05, mask=optim.default_decay_mask),
        "adafactor": optim.adafactor(lr, weight_decay_rate=0.05, weight_decay_mask=optim.default_decay_mask),
    }[name]
    torch.manual_seed(0)
    params = {"w": torch.randn(130, 129), "b": torch.randn(7)}
    mine, theirs = _three_updates(build_optimizer(cfg, 10), params), _three_updates(by_hand, params)
    for k in params:
        torch.testing.assert_close(mine[k], theirs[k], rtol=0, atol=0)
        assert not torch.equal(mine[k], params[k])
    assert parse_config(JobConfig, [f"--optimizer.name={name}"]).optimizer.name == name


def test_the_wsd_decay_fraction_is_a_key():
    from functitan.job_config import OptimizerConfig, learning_rate_schedule

    def lr(fraction: float, step: int) -> float:
        cfg = OptimizerConfig(schedule="wsd", lr=1.0, warmup_steps=0, final_lr_ratio=0.0, decay_fraction=fraction)
        return float(learning_rate_schedule(cfg, 100)(step))

    assert lr(0.1, 60) == 1.0 and lr(0.5, 60) < 1.0 and lr(0.5, 40) == 1.0
    with pytest.raises(ConfigError, match=r"optimizer.decay_fraction=2.0: wsd decays over this share"):
        parse_config(JobConfig, ["--optimizer.decay_fraction=2"])
