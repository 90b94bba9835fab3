"""LowPrecisionTraining(recipe="auto") with a synthetic crossover table: each GEMM follows the table at its expected M
(tokens for dense linears, tokens * top_k / experts for grouped ones), force / keep_bf16 overrides win, a GEMM kept in
bf16 is left untouched (an nn.Linear, the plain grouped GEMM), state-dict keys are unchanged, a missing table keeps
everything in bf16 with a warning naming the bench command, and the mixed model trains (emulated) close to bf16."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

from _memory import gqa_config, reference_model, step, tokens
from lightning_moe.callbacks import LowPrecisionTraining
from lightning_moe.callbacks.low_precision import LowPrecisionGroupedMM, PerShapeGroupedMM
from lightning_moe.lowp.crossover import CrossoverTable, Gemm
from lightning_moe.moe.grouped_mm import TorchGroupedMM

pytest.importorskip("torchao.float8", reason="the fp8 dense linears use torchao (the ao extra)")

TOKENS = 256  # gqa_config: D 64, heads 4 x 16 (wq / wo 64x64, wk / wv 32x64), E 4, top_k 2, F 32, dense MLP 64


def _entry(kind, N, K, recipe, ratios, groups=1):
    return {"kind": kind, "N": N, "K": K, "groups": groups, "recipe": recipe, "names": ["synthetic"],
            "ratios": {str(m): r for m, r in ratios.items()}}


TABLE = {"schema": 1, "arch": "sm90", "m_grid": [64, 128, 256], "entries": [
    # 64x64 (wq, wo, dense MLP): both pay from 128 on, rowwise more
    _entry("dense", 64, 64, "fp8_rowwise", {64: 0.8, 128: 1.1, 256: 1.2}),
    _entry("dense", 64, 64, "fp8_tensorwise", {64: 0.9, 128: 1.0, 256: 1.05}),
    # wk / wv and the shared experts' gate / up (N=32, K=64): never pays
    _entry("dense", 32, 64, "fp8_rowwise", {64: 0.5, 128: 0.7, 256: 0.9}),
    # experts' gate / up: M = 256 * 2 / 4 = 128 rows per expert, pays from 64; down (N=64, K=32): not measured
    _entry("grouped", 32, 64, "fp8_rowwise", {64: 1.3, 128: 1.4}, groups=4),
]}


def _auto(model, **kw):
    kw.setdefault("table", TABLE)
    kw.setdefault("tokens_per_microbatch", TOKENS)
    cb = LowPrecisionTraining(emulate=True, **kw)
    cb.transform_model(model)
    return cb


def _is_fp8(m: nn.Module) -> bool:
    from lightning_moe.lowp.fp8_linear import Fp8Linear

    return isinstance(m, Fp8Linear) or type(m).__name__ == "Float8Linear"


def _choices(cb):
    return {d.gemm.name: d.recipe for d in cb.decisions}


def test_auto_is_the_default_and_follows_the_table():
    assert LowPrecisionTraining().recipe == "auto"
    base = reference_model(gqa_config())
    keys = {k: (v.shape, v.dtype) for k, v in base.state_dict().items()}
    model = copy.deepcopy(base)
    cb = _auto(model)
    ch = _choices(cb)
    assert ch["layers.0.attention.wq"] == ch["layers.2.attention.wo"] == "fp8_rowwise"  # rowwise's 1.2 > 1.05
    assert ch["layers.0.feed_forward.w2"] == "fp8_rowwise"
    assert ch["layers.1.attention.wk"] is None and ch["layers.1.moe.shared_experts.w1"] is None
    assert ch["layers.1.moe.experts.w1_w3"] == "fp8_rowwise" and ch["layers.1.moe.experts.w2"] is None
    why = {d.gemm.name: d.why for d in cb.decisions}
    assert why["layers.1.attention.wk"] == "below crossover" and why["layers.1.moe.experts.w2"] == "shape not in table"
    d = next(d for d in cb.decisions if d.gemm.name == "layers.1.moe.experts.w1_w3")
    assert d.m == TOKENS * 2 / 4 and d.ratio == 1.4 and d.gemm == Gemm("layers.1.moe.experts.w1_w3", "grouped", 32,
                                                                        64, 4)
    # the LM head and the router are no GEMM of the table's
    assert "output" not in ch and not any("router" in n for n in ch)
    # what bf16 was chosen for is left exactly as it was; FP8 only where chosen
    for name, recipe in ch.items():
        if name.endswith((".w1_w3", ".w2")) and ".experts." in name:
            continue
        m = model.get_submodule(name)
        assert _is_fp8(m) == (recipe is not None), name
        if recipe is None:
            assert type(m) is type(base.get_submodule(name)), name
    gmm = model.layers["1"].moe.experts.grouped_mm
    assert isinstance(gmm, PerShapeGroupedMM)  # gate / up FP8, down the plain grouped GEMM
    assert isinstance(gmm.by_shape[(64, 32)], LowPrecisionGroupedMM) and type(gmm.by_shape[(32, 64)]) is TorchGroupedMM
    assert model.layers["1"].moe.plan.grouped_mm is gmm
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == keys
    assert sorted(cb.converted) == sorted(n for n, r in ch.items() if r)


def test_a_layer_whose_gemms_all_stay_bf16_keeps_its_plan():
    table = {**TABLE, "entries": [e for e in TABLE["entries"] if e["kind"] == "dense"]}
    model = reference_model(gqa_config())
    plans = {i: model.layers[i].moe.plan for i in ("1", "2")}
    _auto(model, table=table)
    for i in ("1", "2"):
        assert type(model.layers[i].moe.experts.grouped_mm) is TorchGroupedMM
        assert model.layers[i].moe.plan is plans[i]  # not even re-planned
        assert model.layers[i].moe.plan.regather_rows == plans[i].regather_rows


def test_force_and_keep_override_the_table():
    model = reference_model(gqa_config())
    cb = _auto(model, force=["*.attention.wk", "layers.2.moe.experts.w2"], keep_bf16=["layers.0", "*.attention.wo"])
    ch = _choices(cb)
    assert ch["layers.1.attention.wk"] == "fp8_rowwise" and _is_fp8(model.layers["1"].attention.wk)  # forced
    assert ch["layers.0.attention.wk"] is None and type(model.layers["0"].attention.wk) is nn.Linear  # keep wins
    assert ch["layers.0.attention.wq"] is None and ch["layers.2.attention.wo"] is None  # kept although it pays
    assert type(model.layers["2"].attention.wo) is nn.Linear
    assert ch["layers.2.moe.experts.w2"] == "fp8_rowwise"  # forced, not in the table: the default recipe
    assert isinstance(model.layers["2"].moe.experts.grouped_mm, LowPrecisionGroupedMM)  # both projections FP8
    assert {d.why for d in cb.decisions if d.gemm.name.startswith("layers.0.")} == {"kept"}


def test_patterns_that_name_nothing_are_refused_before_anything_is_converted():
    """A typo in keep_bf16 would silently put in FP8 what the user meant to keep: both pattern lists must name
    something (module names, or an experts module's two grouped GEMMs), else a ValueError that shows real names."""
    model = reference_model(gqa_config())
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"keep_bf16=.*\['\*\.attn\.wo'\] match no module.*layers\.0\.attention"):
        _auto(model, keep_bf16=["layers.0", "*.attn.wo"])
    with pytest.raises(ValueError, match=r"force=.*\['experts\.w2'\] match no module"):
        _auto(model, force=["experts.w2"])  # names are full: layers.N.moe.experts.w2
    assert {n: type(m) for n, m in model.named_modules()} == before  # nothing converted
    with pytest.raises(ValueError, match="match no module"):
        LowPrecisionTraining("fp8_rowwise", emulate=True, keep_bf16=["layers.9"]).transform_model(model)
    cb = _auto(model, force=["*.experts.w2"], keep_bf16=["layers.1.moe.experts.w1_w3"])  # GEMM names are names
    assert _choices(cb)["layers.1.moe.experts.w1_w3"] is None and _choices(cb)["layers.2.moe.experts.w2"] is not None


def test_min_speedup_raises_the_bar():
    cb = _auto(reference_model(gqa_config()), min_speedup=1.25)
    ch = _choices(cb)
    assert ch["layers.0.attention.wq"] is None and ch["layers.1.moe.experts.w1_w3"] == "fp8_rowwise"


def test_missing_table_keeps_everything_bf16_with_a_warning(monkeypatch, tmp_path):
    import lightning_moe.callbacks.low_precision as lp

    monkeypatch.setattr(lp, "shipped_table_path", lambda arch: tmp_path / f"{arch}.json")
    base = reference_model(gqa_config())
    model = copy.deepcopy(base)
    with pytest.warns(UserWarning, match=r"no FP8 crossover table .*bench fp8_crossover"):
        cb = LowPrecisionTraining(emulate=True)  # no tokens needed when there is nothing to look up
        cb.transform_model(model)
    assert cb.converted == [] and {d.why for d in cb.decisions} == {"no table"}
    for (n, a), (_, b) in zip(model.named_modules(), base.named_modules()):
        assert type(a) is type(b), n
    assert all(type(layer.moe.experts.grouped_mm) is TorchGroupedMM for layer in model.layers.values()
               if layer.is_moe)


def test_tokens_come_from_the_datamodule_or_an_error_names_the_argument():
    cb = LowPrecisionTraining(emulate=True, table=TABLE)
    with pytest.raises(ValueError, match="tokens_per_microbatch"):
        cb.transform_model(reference_model(gqa_config()))
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")),
                                    datamodule=types.SimpleNamespace(batch_size=4, seq_len=32))  # 128 tokens
    cb.setup(trainer, None, "fit")
    cb.transform_model(reference_model(gqa_config()))
    d = {d.gemm.name: d for d in cb.decisions}
    assert d["layers.0.attention.wq"].m == 128 and d["layers.0.attention.wq"].recipe == "fp8_rowwise"
    assert d["layers.0.attention.wq"].ratio == 1.1  # the ratio measured at 128, not at 256
    assert d["layers.1.moe.experts.w1_w3"].m == 64 and d["layers.1.moe.experts.w1_w3"].recipe == "fp8_rowwise"
    # below the measured grid nothing is assumed: M = 64 * 2 / 4 = 32 < 64 stays bf16, as does wq at 64 < 128
    cb = _auto(reference_model(gqa_config()), tokens_per_microbatch=64)
    d = {d.gemm.name: d for d in cb.decisions}
    assert d["layers.1.moe.experts.w1_w3"].recipe is None and d["layers.0.attention.wq"].recipe is None


def test_auto_only_arguments_are_refused_with_a_named_recipe():
    with pytest.raises(ValueError, match="only apply to recipe='auto'"):
        LowPrecisionTraining("fp8_rowwise", force=["*"])
    with pytest.raises(ValueError, match="no such file"):
        LowPrecisionTraining(emulate=True, table="/nonexistent.json", tokens_per_microbatch=8).transform_model(
            nn.Sequential(nn.Linear(16, 16)))
    with pytest.raises(ValueError, match="schema"):
        CrossoverTable({"entries": []})


def test_mixed_choice_trains_close_to_bf16():
    cfg = gqa_config()
    ids = tokens(cfg)
    base = reference_model(cfg)
    ref = step(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _auto(model)
    got = step(model, ids)
    err = abs(got["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
    assert 1e-7 < err < 1e-2, err  # quantized somewhere, and not more than FP8 costs
    names = sorted(ref["grads"])
    cat = lambda g: torch.cat([g[n].flatten() for n in names])  # noqa: E731
    assert float((cat(got["grads"]) - cat(ref["grads"])).norm() / cat(ref["grads"]).norm()) < 0.1
    for n in names:  # test_low_precision's per-gradient bound for the FP8 recipes
        g, r = got["grads"][n], ref["grads"][n]
        assert float((g - r).norm() / r.norm()) < 0.3, n
