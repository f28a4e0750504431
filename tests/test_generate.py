"""``functitan generate`` and complete Hugging Face exports: transformers' tokenizer and ``generate`` on an
export give what ``functitan generate`` gives, token for token."""

from __future__ import annotations

import json

import optree
import pytest
import torch
from support import SMALL, cli

from functitan.checkpoint import save_hf
from functitan.data import ByteTokenizer, save_hf_tokenizer
from functitan.generate import SamplingConfig, filter_logits, generate, sample_next
from functitan.model import init, load_model

transformers = pytest.importorskip("transformers")

TEXTS = ("def main(", "  héllo\n\twörld ", "ü€😀 end.")


def _hf_generate(hf_dir, prompt: str, n: int) -> tuple[list[int], list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


def _ours(checkpoint, prompt: str, n: int) -> dict:
    out = cli("generate", "--checkpoint", str(checkpoint), "--prompt", prompt, "--max-new-tokens", str(n), "--ids")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_runs_hf_export_has_its_tokenizer_and_ids_and_transformers_generates_what_functitan_does(tmp_path):
    """A llama run (byte tokenizer) through ``export hf`` as typed: AutoTokenizer encodes as the run's tokenizer
    did, config.json and generation_config.json carry BOS / EOS / pad (256, 257, 257; transformers would
    assume 1 and 2), and transformers' greedy ``generate`` equals ``functitan generate`` on the checkpoint and
    on the export."""
    # one small step: the weights stay near their random init, whose greedy continuation varies (a trained tiny
    # model repeats its most frequent byte)
    flags = [f"--{k}={v}" for k, v in {**SMALL, "training.steps": 1, "optimizer.lr": 1e-5}.items()]
    run = cli("train", *flags, "--checkpoint.enable=true", f"--metrics.run_dir={tmp_path}", "--metrics.run_name=r")
    assert run.returncode == 0, run.stderr
    step, hf = tmp_path / "r" / "checkpoints" / "1", tmp_path / "hf"
    out = cli("export", "hf", str(step), str(hf))
    assert out.returncode == 0 and "with the run's tokenizer, the byte tokenizer" in out.stdout, out.stderr

    tok = transformers.AutoTokenizer.from_pretrained(hf)
    for text in TEXTS:
        assert tok.encode(text) == ByteTokenizer().encode(text).tolist()
        assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 257)
    config = json.loads((hf / "config.json").read_text())
    generation = json.loads((hf / "generation_config.json").read_text())
    for d in (config, generation):
        assert (d["bos_token_id"], d["eos_token_id"], d["pad_token_id"]) == (256, 257, 257)

    prompt_ids, theirs = _hf_generate(hf, "def main(", 24)
    from_step, from_hf = _ours(step, "def main(", 24), _ours(hf, "def main(", 24)
    assert from_step == from_hf == {"prompt_ids": prompt_ids, "ids": theirs}
    assert len(set(theirs)) >= 5, theirs  # a continuation, not one token repeated

    bare = tmp_path / "bare"
    out = cli("export", "hf", str(step), str(bare), "--tokenizer", "none")
    assert out.returncode == 0 and "(no tokenizer: --tokenizer=none)" in out.stdout
    assert not (bare / "tokenizer.json").exists() and not (bare / "generation_config.json").exists()


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_gpt2_and_qwen3_hf_directories_generate_in_functitan_as_in_transformers(tmp_path, family):
    """Random weights saved with the byte tokenizer: ``functitan generate`` on the
    directory equals transformers' greedy ``generate``."""
    model = load_model(family)
    cfg = model.config("debug", vocab_size=258, **({"max_seq_len": 64} if family == "gpt2" else {}))
    torch.manual_seed(3)  # weights of unit scale: init's 0.02 makes one byte win every position
    params = optree.tree_map(lambda x: torch.randn_like(x) * 0.5, init(model.params(cfg), 3))
    save_hf(params, model, cfg, tmp_path, extra_config={"bos_token_id": 256, "eos_token_id": 257})
    save_hf_tokenizer(ByteTokenizer(), tmp_path)
    prompt_ids, theirs = _hf_generate(tmp_path, "import os", 16)
    assert _ours(tmp_path, "import os", 16) == {"prompt_ids": prompt_ids, "ids": theirs}
    assert len(set(theirs)) >= 2, theirs  # the choice moves with the context


def test_top_k_and_top_p_keep_what_transformers_warpers_keep():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
    for k, p in ((0, 0.9), (20, 1.0), (20, 0.5), (1, 1.0), (0, 0.01)):
        theirs = logits
        if k:
            theirs = TopKLogitsWarper(k)(None, theirs)
        if p < 1:
            theirs = TopPLogitsWarper(p)(None, theirs)
        assert torch.equal(filter_logits(logits, top_k=k, top_p=p).isinf(), theirs.isinf()), (k, p)


def test_sampling_is_greedy_at_temperature_0_follows_softmax_otherwise_and_repeats_by_seed():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    assert sample_next(logits, SamplingConfig()).tolist() == [0]
    rows = logits.expand(40_000, -1)
    draws = sample_next(rows, SamplingConfig(temperature=0.7), torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), atol=0.01, rtol=0)
    assert set(sample_next(rows, SamplingConfig(temperature=5.0, top_k=2), torch.Generator()).tolist()) == {0, 1}
    one, two = (sample_next(rows[:50], SamplingConfig(temperature=1.0), torch.Generator().manual_seed(9)) for _ in "ab")
    assert torch.equal(one, two)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "0"], "--top-p=0.0: must be in (0, 1] (1: no top-p)"),
        (["--temperature", "-1"], "--temperature=-1.0: must be >= 0 (0: greedy)"),
        ([], "checkpoint NOWHERE does not exist"),
    ],
)
def test_generate_refuses_bad_input_in_one_line(args, message):
    out = cli("generate", "--checkpoint", "NOWHERE", "--prompt", "x", *args)
    assert out.returncode == 2 and out.stderr.startswith("functitan: error: ") and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_an_hf_directory_without_a_tokenizer_is_one_line_naming_the_flag(tmp_path):
    model = load_model("llama")
    cfg = model.config("debug", vocab_size=258)
    save_hf(init(model.params(cfg), 0), model, cfg, tmp_path)
    out = cli("generate", "--checkpoint", str(tmp_path), "--prompt", "x")
    assert out.returncode == 2 and f"{tmp_path} has no tokenizer.json; pass --tokenizer FILE" in out.stderr


def test_an_imported_checkpoint_exports_no_tokenizer_unless_named_and_a_tiktoken_one_is_refused(tmp_path):
    """``import hf``'s output has no run record: ``export hf`` writes the weights and says how to add a
    tokenizer; with ``--tokenizer FILE`` it writes that one. A tokenizer with no HF form is refused by name."""
    model = load_model("llama")
    cfg = model.config("debug", vocab_size=258)
    save_hf(init(model.params(cfg), 0), model, cfg, tmp_path / "src")
    save_hf_tokenizer(ByteTokenizer(), tmp_path / "tok")
    assert cli("import", "hf", str(tmp_path / "src"), str(tmp_path / "ck")).returncode == 0
    out = cli("export", "hf", str(tmp_path / "ck"), str(tmp_path / "a"))
    assert "(no tokenizer: this checkpoint has no run record; add one with --tokenizer=FILE)" in out.stdout
    assert not (tmp_path / "a" / "tokenizer.json").exists()
    tok_file = tmp_path / "tok" / "tokenizer.json"
    out = cli("export", "hf", str(tmp_path / "ck"), str(tmp_path / "b"), "--tokenizer", str(tok_file))
    assert out.returncode == 0 and f"(tokenizer {tok_file})" in out.stdout
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "b").encode("hé") == [104, 195, 169]

    class Ranks:  # a tokenizer of another kind (tiktoken's) behind the protocol
        vocab_size, bos_id, eos_id = 258, 256, 257

    with pytest.raises(ValueError, match=r"the run's tokenizer \(Ranks\) has no Hugging Face form in functitan yet"):
        save_hf_tokenizer(Ranks(), tmp_path / "c")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_the_kv_cache_gives_the_tokens_of_a_whole_forward_per_token(family):
    """Greedy and sampled: the prompt once, then one token per forward through ``KVCache``, equal to a whole
    forward over the context per token (the first cached step is the only one checked against one)."""
    model = load_model(family)
    cfg = model.config("debug", vocab_size=258)
    torch.manual_seed(0)
    params = optree.tree_map(lambda x: torch.randn_like(x) * 0.3, init(model.params(cfg), 0))
    for sampling in (SamplingConfig(max_new_tokens=40), SamplingConfig(max_new_tokens=40, temperature=0.9, top_k=50)):
        cached, whole = {}, {}
        fast = generate(model, cfg, params, [10, 20, 30, 40], sampling, kv_cache=True, stats=cached)
        slow = generate(model, cfg, params, [10, 20, 30, 40], sampling, kv_cache=False, stats=whole)
        assert fast == slow and len(set(fast)) >= 2, (fast, slow)
        assert cached == {"cached": 40, "full": 1} and whole == {"cached": 0, "full": 40}


def test_a_model_with_attention_or_positions_of_its_own_generates_without_the_cache():
    """tests/assets/tiny_gpt.py calls F.scaled_dot_product_attention itself and counts positions from 0: the
    cache stays empty, so every token is a whole forward, and the tokens are right."""
    from pathlib import Path

    model = load_model(str(Path(__file__).parent / "assets" / "tiny_gpt.py"))
    cfg = model.config("debug")
    params = init(model.params(cfg), 1)
    stats = {}
    fast = generate(model, cfg, params, [1, 2, 3], SamplingConfig(max_new_tokens=12), stats=stats)
    assert fast == generate(model, cfg, params, [1, 2, 3], SamplingConfig(max_new_tokens=12), kv_cache=False)
    assert stats == {"cached": 0, "full": 12}


def test_a_model_whose_positions_ignore_the_cache_is_caught_at_the_first_cached_step(monkeypatch):
    """A KV cache whose past_len a model does not read (as a model counting its own positions would): the first
    cached step differs from the whole forward, so generation goes on without the cache, with the right tokens."""
    import functitan.generate._sample as sample
    from functitan.generate import KVCache

    class Unread(KVCache):
        @property
        def past_len(self) -> int:
            return 0

    model = load_model("llama")
    cfg = model.config("debug", vocab_size=258)
    torch.manual_seed(0)
    params = optree.tree_map(lambda x: torch.randn_like(x) * 0.3, init(model.params(cfg), 0))
    want = generate(model, cfg, params, [10, 20, 30], SamplingConfig(max_new_tokens=20), kv_cache=False)
    monkeypatch.setattr(sample, "KVCache", Unread)
    stats = {}
    assert generate(model, cfg, params, [10, 20, 30], SamplingConfig(max_new_tokens=20), stats=stats) == want
    assert stats == {"cached": 1, "full": 19}  # token 1 from the prompt through the cache; the check on, whole
