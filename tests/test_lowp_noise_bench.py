"""The convergence bench's ``noise`` arm (``bench/lowp_noise.py``): the bf16 program with zero-mean noise of FP8's
size on the GEMMs a forced recipe converts. With sigma 0 it is the baseline's program bit for bit (the wrapper is
otherwise transparent, forward and backward); with the default sigma the noise has the size it claims, changes the
run, is reproducible from the seed, and is off inside ``high_precision()`` (so ``--conv-grad-check`` measures it)."""

from __future__ import annotations

import pytest
import torch

from bench.lowp_noise import FP8_ROWWISE_SIGMA, NoiseInjection, _noisy
from lightning_moe.lowp.fp8_grouped import quantize_rowwise
from test_low_precision_bench import _run, bench  # noqa: F401  (the fixture)


def test_noise_has_the_size_it_claims_and_matches_a_rowwise_fp8_gemm():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(512, 1024, generator=g) * torch.linspace(0.1, 10, 512)[:, None]  # rows of very different rms
    e = _noisy(t, 0.05, torch.Generator().manual_seed(1), rowwise=True) - t
    rel = e / t.pow(2).mean(-1, keepdim=True).sqrt()
    assert rel.mean().abs() < 2e-3 and rel.std().item() == pytest.approx(0.05, rel=0.02)
    assert rel.std(dim=-1).min() > 0.045  # per row, whatever the row's scale
    e_all = _noisy(t, 0.05, torch.Generator().manual_seed(1), rowwise=False) - t
    assert (e_all.std() / t.pow(2).mean().sqrt()).item() == pytest.approx(0.05, rel=0.02)
    # the default is a rowwise e4m3 GEMM's relative output error (emulation, Gaussian operands)
    x, w = torch.randn(1024, 1024, generator=g), torch.randn(512, 1024, generator=g) * 0.02

    def qdq(a):
        q, s = quantize_rowwise(a, torch.float32)
        return q * s[:, None]

    y = x @ w.t()
    fp8_rel = ((qdq(x) @ qdq(w).t() - y).pow(2).mean() / y.pow(2).mean()).sqrt().item()
    assert FP8_ROWWISE_SIGMA == pytest.approx(fp8_rel, rel=0.05)


def test_noise_arm_converts_what_fp8_would_and_sigma_zero_is_the_baseline(bench, tmp_path):  # noqa: F811
    conv = ["--mode", "convergence", "--recipes", "noise,fp8_rowwise", "--noise-seed", "0"]
    zero, _ = _run(bench, tmp_path / "z", *conv, "--noise-sigma", "0")
    runs = {r["recipe"]: r for r in zero["convergence"]["runs"]}
    base, noise, fp8 = runs["baseline"], runs["noise"], runs["fp8_rowwise"]
    assert noise["init_checksum"] == base["init_checksum"]
    assert noise["losses"] == base["losses"]  # sigma 0: the same program, forward and backward
    assert sorted(noise["converted"]) == sorted(fp8["converted"])  # the same GEMMs as forced FP8, head kept
    assert not any(n.endswith("output") for n in noise["converted"])
    summary = next(s for s in zero["convergence"]["summary"] if s["recipe"] == "noise")
    assert summary["target"] is None and summary["ok"] is None and "noise" in summary["note"]

    a, _ = _run(bench, tmp_path / "a", "--mode", "convergence", "--recipes", "noise", "--noise-seed", "0",
                "--conv-grad-check", "1", "--conv-grad-window", "1")
    b, _ = _run(bench, tmp_path / "b", "--mode", "convergence", "--recipes", "noise", "--noise-seed", "0")
    na = next(r for r in a["convergence"]["runs"] if r["recipe"] == "noise")
    nb = next(r for r in b["convergence"]["runs"] if r["recipe"] == "noise")
    assert na["noise_sigma"] == FP8_ROWWISE_SIGMA
    assert na["losses"] != base["losses"] and na["losses"] == nb["losses"]  # it matters; seeded, reproducible
    # high_precision() turns the noise off: the check sees the noise's gradient error
    rows = na["grad_check"]["steps"][0]["groups"]
    assert rows["attention.wq"]["rel_err"] > 0.01 and rows["experts.w1"]["rel_err"] > 0.01
    assert all(0 < r["cos"] <= 1 + 1e-9 for r in rows.values())


def test_noise_sigma_must_be_non_negative():
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        NoiseInjection(-0.1)
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        NoiseInjection(float("nan"))
