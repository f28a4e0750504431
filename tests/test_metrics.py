"""Tests for functitan.metrics: FLOPs, peak FLOP/s, MFU, memory and the sinks."""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import json
import math
import os
import time
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from functitan.metrics import (
    ConsoleSink,
    JsonlSink,
    Meter,
    MultiSink,
    PeakFlops,
    TensorBoardSink,
    make_sinks,
    peak_flops,
    peak_memory,
    reset_peak_memory,
    throughput,
    transformer_flops_per_token,
)

# --- FLOPs ---------------------------------------------------------------------------------------------


def test_flops_hand_calculation():
    # vocab 100, dim 16, 2 layers, 4 heads x 4, ffn 64, untied head, no norms or biases, seq 8.
    # per layer: q,k,v,o 4*16*16 = 1024, mlp 2*16*64 = 2048 -> 3072; two layers 6144.
    # embedding 100*16 = 1600 (excluded), head 16*100 = 1600 (kept): matmul params 7744.
    # 6 * 7744 = 46464; attention 12 * 2 * 4 * 4 * 8 = 3072; total 49536.
    got = transformer_flops_per_token(
        n_params=1600 + 6144 + 1600, n_layers=2, n_heads=4, head_dim=4, seq_len=8, n_embedding_params=1600
    )
    assert got == 49536


# A tiny causal transformer written out with explicit matmuls, so FlopCounterMode sees every one.
_V, _D, _L, _H, _Q, _FF, _B, _T = 96, 32, 2, 4, 8, 64, 2, 16


def _tiny_params(gen):
    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).requires_grad_()

    p = {"embed": w(_V, _D), "head": w(_D, _V), "norm": torch.ones(_D, requires_grad=True)}
    for i in range(_L):
        p.update(
            {
                f"{i}.wq": w(_D, _H * _Q),
                f"{i}.wk": w(_D, _H * _Q),
                f"{i}.wv": w(_D, _H * _Q),
                f"{i}.wo": w(_H * _Q, _D),
                f"{i}.w1": w(_D, _FF),
                f"{i}.w2": w(_FF, _D),
                f"{i}.n1": torch.ones(_D, requires_grad=True),
                f"{i}.n2": torch.ones(_D, requires_grad=True),
            }
        )
    return p


def _rms(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g


def _tiny_apply(p, tokens):  # tokens: (B, T) -> logits (B, T, V)
    x = p["embed"][tokens]  # (B, T, D): a gather, no FLOPs
    causal = torch.ones(_T, _T, dtype=torch.bool).tril()
    for i in range(_L):
        h = _rms(x, p[f"{i}.n1"])
        q, k, v = (torch.matmul(h, p[f"{i}.{n}"]).view(_B, _T, _H, _Q).transpose(1, 2) for n in ("wq", "wk", "wv"))
        scores = torch.matmul(q, k.transpose(-1, -2)) / _Q**0.5  # (B, H, T, T): full, masked below
        attn = torch.matmul(scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        x = x + torch.matmul(attn.transpose(1, 2).reshape(_B, _T, _H * _Q), p[f"{i}.wo"])
        x = x + torch.matmul(F.gelu(torch.matmul(_rms(x, p[f"{i}.n2"]), p[f"{i}.w1"])), p[f"{i}.w2"])
    return torch.matmul(_rms(x, p["norm"]), p["head"])


def test_flops_match_flop_counter_on_a_tiny_causal_transformer():
    gen = torch.Generator().manual_seed(0)
    p = _tiny_params(gen)
    tokens = torch.randint(0, _V, (_B, _T), generator=gen)
    with FlopCounterMode(display=False) as counter:
        loss = F.cross_entropy(_tiny_apply(p, tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
    measured = counter.get_total_flops() / (_B * _T)
    n_all = sum(v.numel() for v in p.values())
    n_norm = sum(v.numel() for k, v in p.items() if k.endswith(("n1", "n2", "norm")))
    kw = dict(n_layers=_L, n_heads=_H, head_dim=_Q, seq_len=_T, n_embedding_params=_V * _D)
    # Counting only the params that do matmuls, the formula is exact: causal masking is not halved.
    assert transformer_flops_per_token(n_params=n_all - n_norm, **kw) == measured == 129024
    # With every param (norm gains too, as trainers pass it), it is within 1% (here +0.74%).
    approx = transformer_flops_per_token(n_params=n_all, **kw)
    assert approx == pytest.approx(measured, rel=0.01)
    assert approx - measured == 6 * n_norm


def test_flops_rejects_bad_input_with_a_fix():
    with pytest.raises(ValueError, match=r"n_embedding_params=200 exceeds n_params=100.*embedding table included"):
        transformer_flops_per_token(n_params=100, n_layers=1, n_heads=1, head_dim=1, seq_len=1, n_embedding_params=200)
    with pytest.raises(ValueError, match=r"seq_len must be a non-negative int, got -3"):
        transformer_flops_per_token(n_params=100, n_layers=1, n_heads=1, head_dim=1, seq_len=-3)


# --- peak FLOP/s ---------------------------------------------------------------------------------------


def _fake_gpu(monkeypatch, name, sms=None):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(multi_processor_count=sms)
    )


@pytest.mark.parametrize(
    "name, dtype, tflops, source",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4, "table:H100 SXM"),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5, "table:H100 PCIe"),
        ("NVIDIA H200", torch.float16, 989.4, "table:H200"),
        ("NVIDIA GH200 480GB", torch.bfloat16, 989.4, "table:GH200"),
        ("NVIDIA H20", torch.bfloat16, 148.0, "table:H20"),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0, "table:A100"),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5, "table:A100 fp32"),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0, "table:A100 tf32"),
        ("NVIDIA A10G", torch.bfloat16, 125.0, "table:A10G(A10 datasheet)"),
        ("NVIDIA L4", torch.bfloat16, 121.0, "table:L4"),
        ("NVIDIA L40S", torch.bfloat16, 362.05, "table:L40S"),
        ("Tesla V100-SXM2-16GB", torch.float16, 125.0, "table:V100 SXM2"),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4, "table:MI300X"),
    ],
)
def test_peak_table_matches_device_names(monkeypatch, name, dtype, tflops, source):
    _fake_gpu(monkeypatch, name)
    got = peak_flops("cuda", dtype)
    assert got == PeakFlops(pytest.approx(tflops * 1e12), source)


def test_peak_fp32_means_tf32_when_tf32_matmuls_are_on(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    from functitan.metrics import _peak

    assert _peak._cuda_fp32_uses_tf32() is False  # torch's default: IEEE fp32 matmuls
    # Flipping torch's own flag here would leak into other tests (mixing its legacy and new TF32 APIs
    # raises), so the reader of the flag is patched instead.
    monkeypatch.setattr(_peak, "_cuda_fp32_uses_tf32", lambda: True)
    assert peak_flops("cuda:0", torch.float32) == PeakFlops(pytest.approx(494.7e12), "table:H100 SXM tf32")


def test_peak_mig_slice_is_scaled_by_its_sms(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", sms=16)  # a 1g.10gb slice
    got = peak_flops("cuda", torch.bfloat16)
    assert got.value == pytest.approx(989.4e12 * 16 / 132)
    assert got.source == "table:H100 SXM x16/132 SMs"


def test_unknown_gpu_gives_no_peak_and_no_mfu(monkeypatch, capsys):
    _fake_gpu(monkeypatch, "NVIDIA Imaginary X9")
    peak = peak_flops("cuda", torch.bfloat16)
    assert peak == PeakFlops(None, "unknown:NVIDIA Imaginary X9")
    out = throughput(wall_s=1.0, data_s=0.0, tokens=1000, world_size=1, flops_per_token=6e9, peak=peak)
    assert out["mfu"] is None and out["tflops"] == pytest.approx(6.0)
    ConsoleSink(10).write(1, out)
    assert "MFU n/a" in capsys.readouterr().out
    # A known chip without the units for the dtype: absent too, not a guess.
    _fake_gpu(monkeypatch, "Tesla V100-SXM2-32GB")
    assert peak_flops("cuda", torch.bfloat16) == PeakFlops(None, "table:V100 SXM2 has no bf16 peak")
    assert peak_flops("meta", torch.bfloat16) == PeakFlops(None, "unknown:meta")


def test_peak_rejects_unknown_dtype():
    with pytest.raises(ValueError, match=r"no peak is tabled for dtype torch.int8.*torch.bfloat16"):
        peak_flops("cpu", torch.int8)


def test_cpu_peak_is_calibrated_and_cached():
    t0 = time.perf_counter()
    first = peak_flops("cpu", torch.float32)
    took = time.perf_counter() - t0
    assert first.source == "cpu-calibrated"
    assert 1e6 < first.value < 1e15
    assert took < 2.0
    t0 = time.perf_counter()
    assert peak_flops(torch.device("cpu"), "float32") == first  # cached: same number, no new timing
    assert time.perf_counter() - t0 < 0.01


def test_cpu_calibration_takes_the_best_round_so_a_busy_moment_does_not_lower_the_peak(monkeypatch):
    from functitan.metrics import _peak

    rounds = []

    def timed(a, b, budget_s):  # 100 GFLOP/s, except during a burst of load (the whole first round): 10x slower
        if a.shape[0] == 128:  # a round starts
            rounds.append([])
        rounds[-1].append(a.shape[0])
        return 2 * a.shape[0] ** 3 / 100e9 * (10 if len(rounds) == 1 else 1)

    monkeypatch.setattr(_peak, "_best_mm_seconds", timed)
    assert _peak._cpu_calibrated.__wrapped__(torch.float32, 1) == pytest.approx(100e9)
    assert rounds == [[128, 256, 512], [128, 256, 512, 1024], [128, 256, 512, 1024]]


def test_an_achieved_rate_above_the_peak_is_no_mfu_but_a_flagged_ratio():
    # 5.4x the calibrated peak: the calibration ran slow; an "MFU 540%" would be printed as a fact
    out = throughput(
        wall_s=1.0, data_s=0.0, tokens=1000, world_size=1, flops_per_token=5.4e9, peak=PeakFlops(1e12, "cpu-calibrated")
    )
    assert out["mfu"] is None and out["mfu_above_peak"] == pytest.approx(5.4)
    line = ConsoleSink(10, stream=io.StringIO()).format(1, out)
    assert "MFU n/a | achieved/peak 5.40 (peak underestimated)" in line and "540" not in line
    exact = throughput(wall_s=1.0, data_s=0.0, tokens=1000, world_size=1, flops_per_token=1e9, peak=1e12)
    assert exact["mfu"] == pytest.approx(100.0) and "mfu_above_peak" not in exact


# --- memory --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="VmHWM reset needs Linux /proc")
def test_cpu_peak_rss_resets():
    # the trainer asks malloc to keep freed memory (functitan.hostmem), process-wide, and earlier in-process runs
    # may have: hand what they freed back to the system first, or the tensor below reuses those resident pages
    # (0.153 of its 0.186 GiB showed up once the suite ran eval and generate in-process before this file)
    trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    trim(0)
    assert reset_peak_memory("cpu") is True
    before = peak_memory("cpu")["mem_max_rss_gib"]
    big = torch.ones(50_000_000)  # 200 MB, pages touched
    during = peak_memory("cpu")["mem_max_rss_gib"]
    del big
    trim(0)  # the block back to the system too: the kernel's peak can only drop to what is still resident
    assert reset_peak_memory("cpu") is True
    after = peak_memory("cpu")["mem_max_rss_gib"]
    assert during - before > 0.17  # GiB: the 0.186 GiB tensor shows up in the peak
    assert during - after > 0.15  # and is gone from it after the reset


# --- meter ---------------------------------------------------------------------------------------------


def test_throughput_by_hand():
    # 4 devices, 2 steps in 2 s (0.5 s of it waiting for data), 65536 tokens, 1e9 FLOPs/token, 100 TFLOP/s peak.
    out = throughput(
        wall_s=2.0,
        data_s=0.5,
        tokens=65536,
        world_size=4,
        flops_per_token=1e9,
        peak=PeakFlops(100e12, "table:x"),
        steps=2,
    )
    assert out == {
        "tokens_per_s": 32768.0,
        "tokens_per_s_per_device": 8192.0,
        "tflops": pytest.approx(8.192),
        "mfu": pytest.approx(8.192),
        "step_time_s": 1.0,
        "data_time_s": 0.25,
    }
    with pytest.raises(ValueError, match=r"data_s=3.0 must lie in \[0, wall_s=2.0\]"):
        throughput(wall_s=2.0, data_s=3.0, tokens=1, world_size=1, flops_per_token=1, peak=None)


def test_meter_sums_a_window_and_restarts():
    m = Meter(world_size=2, flops_per_token=6e9, peak=1e15)
    m.update(wall_s=0.5, data_s=0.1, tokens=4096)
    m.update(wall_s=0.5, data_s=0.1, tokens=4096)
    out = m.flush()
    assert out["tokens_per_s"] == 8192.0 and out["step_time_s"] == 0.5
    assert out["data_time_s"] == pytest.approx(0.1)
    assert out["mfu"] == pytest.approx(100 * 6e9 * 4096 / 1e15)
    with pytest.raises(ValueError, match="no step was recorded since the last flush"):
        m.flush()


# --- sinks ---------------------------------------------------------------------------------------------

_METRICS = {
    "loss": 2.3456,
    "grad_norm": 0.987,
    "lr": 3e-4,
    "tokens_per_s": 12345.0,
    "tflops": 45.6,
    "mfu": 38.25,
    "mem_max_reserved_gib": 12.5,
    "step_time_s": 0.25,
}


def test_console_non_tty_prints_plain_lines_with_the_numbers(capsys):
    clock = iter([100.0, 130.0]).__next__
    sink = ConsoleSink(1000, clock=clock)
    sink.write(10, _METRICS)
    sink.write(40, {**_METRICS, "mfu": None})
    sink.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "\r" not in lines[0]
    assert lines[0] == (
        "step   10/1000 | loss 2.3456 | gnorm 0.987 | lr 3.00e-04 | tok/s 12.35k | "
        "TFLOP/s 45.6 | MFU 38.2% | mem 12.50GiB | eta ?"
    )
    # 30 steps took 30 s, 960 to go: 0:16:00.
    assert lines[1].endswith("MFU n/a | mem 12.50GiB | eta 0:16:00")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_console_tty_redraws_one_line_with_a_bar(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the line is cut to the terminal width
    stream = _Tty()
    sink = ConsoleSink(100, stream=stream)
    sink.write(50, {"loss": 1.5})
    sink.write(100, {"loss": 1.25})
    text = stream.getvalue()
    assert text.count("\r") == 2 and "\n" not in text
    assert "[##########          ]  50% step  50/100 | loss 1.5000" in text
    assert "[####################] 100% step 100/100 | loss 1.2500 | eta 0:00:00" in text
    sink.close()
    assert stream.getvalue().endswith("\n")


def test_jsonl_lines_parse_back(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.write(1, {"loss": torch.tensor(2.5), "mfu": None, "tokens": 4096})
    sink.write(2, {"loss": float("nan")})
    assert len(path.read_text().splitlines()) == 2  # flushed before close
    sink.close()
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert (first["step"], first["loss"], first["mfu"], first["tokens"]) == (1, 2.5, None, 4096)
    assert first["time"] > 1.6e9
    assert second["step"] == 2 and math.isnan(second["loss"])


def test_sinks_name_a_bad_metric(tmp_path):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(TypeError, match=r"metric 'loss': expected an int, a float.*got Tensor.*loss.item\(\)"):
        sink.write(1, {"loss": torch.ones(3)})
    sink.close()


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(1, {"loss": 3.0, "mfu": None, "eval/loss": 3.5, "mine": 1})
    sink.write(2, {"loss": 2.5, "mfu": 40.0})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 3.0), (2, 2.5)]  # tagged by its group
    assert [(e.step, e.value) for e in acc.Scalars("perf/mfu")] == [(2, 40.0)]  # None was skipped
    assert sorted(acc.Tags()["scalars"]) == ["eval/loss", "mine", "perf/mfu", "train/loss"]  # eval/, unlisted: as is


def test_make_sinks_gives_rank_zero_everything_and_others_nothing(tmp_path, capsys):
    with make_sinks(tmp_path, 5, rank=1) as other:
        assert other.sinks == ()
        other.write(1, {"loss": 1.0})
    sinks = make_sinks(tmp_path, 5, rank=0)
    assert [type(s) for s in sinks.sinks] == [ConsoleSink, JsonlSink, TensorBoardSink]
    sinks.write(3, {"loss": 1.0})
    sinks.close()
    assert "step 3/5 | loss 1.0000" in capsys.readouterr().out
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def test_multisink_closes_all_and_reraises_the_first_error():
    closed = []

    class Bad:
        def write(self, step, metrics):
            pass

        def close(self):
            closed.append("bad")
            raise OSError("disk gone")

    class Good(Bad):
        def close(self):
            closed.append("good")

    with pytest.raises(OSError, match="disk gone"):
        MultiSink([Bad(), Good()]).close()
    assert closed == ["bad", "good"]
