"""Generation: the KV cache reproduces the full forward (GQA with every qk-norm, MLA; MoE, first-k-dense and shared
experts; left-padded ragged batches), cached greedy decoding equals uncached, sampling, EOS, argument errors,
loading single-file and distributed (2-rank ep=2) checkpoints in one process, and the command line."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from _dist import run_distributed
from parallel_harness import FixedData, small_config

from lightning_moe.config import ModelConfig
from lightning_moe.data.tokenizer import ByteTokenizer
from lightning_moe.generation import (
    generate,
    generate_any,
    generate_main,
    generate_text,
    load_for_generation,
    sample_next_token,
)
from lightning_moe.models.transformer import KVCache, MoETransformer

MLA = dict(attention="mla", qk_norm="none", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
VARIANTS = {
    "gqa-none": dict(qk_norm="none"),
    "gqa-head": dict(qk_norm="head"),
    "gqa-full": dict(qk_norm="full"),
    "mla": MLA,
    "mla-qlora": dict(MLA, q_lora_rank=24),
}


def make_config(variant: str = "gqa-head", **moe_overrides) -> ModelConfig:
    # first layer dense, then MoE layers with shared experts; sigmoid routing with an expert bias (set below)
    moe = dict(num_experts=4, top_k=2, expert_hidden_size=32, shared_expert_hidden_size=16, first_k_dense=1,
               score_func="sigmoid", expert_bias=True)
    moe.update(moe_overrides)
    # a large init_std makes attention peaked and logits large, so wrong positions or masks show
    return ModelConfig.from_preset(
        "tiny", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, dense_hidden_size=64,
        max_seq_len=48, init_std=0.15, moe=moe, **VARIANTS[variant],
    )


def make_model(cfg: ModelConfig, seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    model.init_weights()
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.expert_bias.normal_(0, 0.05)
    return model.eval()


def tokens(shape, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def cached_logits(model, ids, chunks, attention_mask=None) -> torch.Tensor:
    """Logits of ``ids`` fed through a KV cache in chunks of the given sizes (the first chunk is the prefill)."""
    B, S = ids.shape
    assert sum(chunks) == S
    cache = KVCache(B, S)
    out, start = [], 0
    for n in chunks:
        mask = None if attention_mask is None else attention_mask[:, : start + n][:, start:]
        out.append(model(ids[:, start : start + n], mask, cache=cache))
        start += n
    assert cache.length == S
    return torch.cat(out, dim=1)


# ---- KV cache == full forward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_logits_equal_full_forward(variant):
    model = make_model(make_config(variant))
    ids = tokens((2, 24))
    with torch.no_grad():
        full = model(ids)
        # prefill 9, then one token at a time, then a chunk of 3 against a non-empty cache, then one at a time
        inc = cached_logits(model, ids, [9] + [1] * 6 + [3] + [1] * 6)
        # the test can fail: other positions change the logits by far more than the tolerance
        shifted = model(ids, positions_S=torch.arange(24) * 2)
    assert full.abs().max() > 1.0
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)
    assert (shifted - full).abs().max() > 1e-2


@pytest.mark.parametrize("variant", ["gqa-head", "gqa-full", "mla"])
def test_left_padded_ragged_batch_decodes_each_prompt_as_alone(variant):
    model = make_model(make_config(variant))
    lengths, width, new = [11, 4, 8], 11, 7
    ids = tokens((3, width + new), seed=2)
    mask = torch.ones_like(ids)
    for i, n in enumerate(lengths):
        mask[i, : width - n] = 0
        ids[i, : width - n] = 255 - i  # padding ids are ignored: they must not matter
    with torch.no_grad():
        inc = cached_logits(model, ids, [width] + [1] * new, attention_mask=mask)
        for i, n in enumerate(lengths):
            alone = model(ids[i : i + 1, width - n :])[0]
            torch.testing.assert_close(inc[i, width - n :], alone, rtol=1e-5, atol=1e-5)
        # and the uncached forward with per-sequence positions agrees too
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        full = model(ids, mask, positions_S=pos)
    real = mask.bool()
    torch.testing.assert_close(full[real], inc[real], rtol=1e-5, atol=1e-5)


def test_cache_rejects_overflow_and_explicit_positions():
    model = make_model(make_config())
    cache = KVCache(1, 4)
    with torch.no_grad():
        model(tokens((1, 3)), cache=cache)
        with pytest.raises(ValueError, match="holds 4 slots"):
            model(tokens((1, 2)), cache=cache)
        with pytest.raises(ValueError, match="positions follow the cache"):
            model(tokens((1, 1)), positions_S=torch.tensor([3]), cache=cache)
        with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
            model(tokens((1, 1)), cache=KVCache(1, 100))


# ---- generate -----------------------------------------------------------------------------------------------------


def ragged_prompts(width: int = 10):
    ids = tokens((3, width), seed=5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    return ids, mask


@pytest.mark.parametrize("variant", ["gqa-head", "mla"])
def test_greedy_with_cache_equals_without_and_each_prompt_alone(variant):
    # a capacity factor that would drop tokens in training: generation is dropless, so the paths still agree
    model = make_model(make_config(variant, capacity_factor=0.5))
    ids, mask = ragged_prompts()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=12)
    ref = generate(model, ids, attention_mask=mask, max_new_tokens=12, use_cache=False)
    assert out.shape == (3, 22)
    assert torch.equal(out, ref)
    assert torch.equal(out[:, :10], ids)
    for i in range(3):
        alone = generate(model, ids[i][mask[i].bool()], max_new_tokens=12)
        assert torch.equal(alone[-12:], out[i, 10:])
    assert len(set(map(tuple, out[:, 10:].tolist()))) == 3  # not a degenerate constant continuation


def test_generation_leaves_training_state_alone():
    model = make_model(make_config(capacity_factor=0.5)).train()
    layer = model.moe_layers()[0]
    ids = tokens((2, 6))
    before = model(ids, labels_BS=ids)  # a training forward, before and after the generation: the same record
    bias, cfg = layer.router.expert_bias.clone(), layer.router.config
    generate(model, ids, max_new_tokens=4)
    assert model.training
    assert torch.equal(layer.router.expert_bias, bias)
    assert layer.router.config is cfg and cfg.capacity_factor == 0.5  # capacity dropping is back
    after = model(ids, labels_BS=ids)
    assert sorted(after.moe) == sorted(before.moe)
    for i, rec in before.moe.items():
        assert int(rec.routing.num_dropped) > 0  # capacity 0.5 drops in training forwards
        for a, b in zip(rec.routing.values(), after.moe[i].routing.values()):
            assert (a is None and b is None) or torch.equal(a, b)
        torch.testing.assert_close(after.moe[i].aux_loss, rec.aux_loss, rtol=0, atol=0)


def test_eos_stops_each_sequence():
    model = make_model(make_config())
    ids, mask = ragged_prompts()
    free = generate(model, ids, attention_mask=mask, max_new_tokens=10)
    eos = int(free[0, 10 + 2])  # sequence 0's third new token
    pad = 258
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=pad)
    for i in range(3):
        new = free[i, 10:].tolist()
        stop = new.index(eos) if eos in new else None
        if stop is None:
            assert out[i, 10:].tolist() == new[: out.shape[1] - 10]
        else:
            assert out[i, 10 : 11 + stop].tolist() == new[: stop + 1]
            assert (out[i, 11 + stop :] == pad).all()
    # one sequence: generation ends at its EOS
    single = generate(model, ids[0][mask[0].bool()], max_new_tokens=10, eos_token_id=eos)
    assert single.shape[0] == 6 + 3 and int(single[-1]) == eos


def test_sampling_reproducible_and_top_p_tiny_is_greedy():
    model = make_model(make_config())
    ids, mask = ragged_prompts()
    kw = dict(attention_mask=mask, max_new_tokens=10, temperature=1.0, top_p=0.9)
    a = generate(model, ids, generator=torch.Generator().manual_seed(0), **kw)
    b = generate(model, ids, generator=torch.Generator().manual_seed(0), **kw)
    c = generate(model, ids, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=10)
    assert not torch.equal(a, greedy)
    tiny = generate(model, ids, attention_mask=mask, max_new_tokens=10, temperature=1.5, top_p=1e-6,
                    generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny, greedy)
    top1 = generate(model, ids, attention_mask=mask, max_new_tokens=10, temperature=2.0, top_k=1)
    assert torch.equal(top1, greedy)


def test_top_p_and_top_k_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, -1)
    g = torch.Generator().manual_seed(0)
    nucleus = sample_next_token(logits, 1.0, top_p=0.7, generator=g)  # 0.5 < 0.7 <= 0.8: tokens {0, 1}
    assert set(nucleus.tolist()) == {0, 1}
    assert abs((nucleus == 0).float().mean().item() - 0.5 / 0.8) < 0.03
    top3 = sample_next_token(logits, 1.0, top_k=3, generator=g)
    assert set(top3.tolist()) == {0, 1, 2}
    everything = sample_next_token(logits, 1.0, generator=g)
    assert set(everything.tolist()) == {0, 1, 2, 3}


def test_generate_argument_errors():
    model = make_model(make_config())  # max_seq_len 48
    ids = tokens((2, 40))
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=48"):
        generate(model, ids, max_new_tokens=9)
    generate(model, ids, max_new_tokens=8)  # exactly fits
    # more new tokens than the model's whole length: no prompt length fixes it (not "at most -52 tokens")
    with pytest.raises(ValueError, match=r"max_seq_len=48: ask for at most 8 new tokens$"):
        generate(model, ids, max_new_tokens=100)
    with pytest.raises(ValueError, match=r"shorten the prompt to at most 38 tokens or ask for at most 8 new"):
        generate(model, ids, max_new_tokens=10)
    ok = tokens((1, 4))
    for kw, msg in [
        (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=-1), "max_new_tokens"), (dict(eos_token_id=260), "eos_token_id"),
    ]:
        with pytest.raises(ValueError, match=msg):
            generate(model, ok, **{"max_new_tokens": 2, **kw})
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(model, torch.tensor([[1, 2, 260]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(model, torch.tensor([[1, -1, 3]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="left padding"):
        generate(model, ok, attention_mask=torch.tensor([[1, 1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="integer token ids"):
        generate(model, ok.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)


def test_generate_text_and_generate_any():
    model = make_model(make_config())
    tok = ByteTokenizer()
    prompts = ["def f(x):", "héllo"]
    texts = generate_text(model, tok, prompts, max_new_tokens=6)
    assert len(texts) == 2
    for p, t in zip(prompts, texts):
        ids = torch.tensor(tok.encode(p))
        alone = generate(model, ids, max_new_tokens=6, eos_token_id=tok.EOS)[len(ids):]
        cut = alone.tolist()
        cut = cut[: cut.index(tok.EOS)] if tok.EOS in cut else cut
        assert t == tok.decode(cut)
    assert generate_any(model, prompts[0], max_new_tokens=6) == texts[0]
    assert generate_any(model, prompts, max_new_tokens=6) == texts
    ids = torch.tensor(tok.encode(prompts[0]))
    assert torch.equal(generate_any(model, ids, max_new_tokens=3), generate(model, ids, max_new_tokens=3))
    # stops at the tokenizer's EOS (not included in the text): a model that always writes EOS writes nothing
    model.output = _Always(tok.EOS)
    assert generate_text(model, tok, ["abc", "de"], max_new_tokens=5) == ["", ""]
    model.output = _Always(ord("z"))
    assert generate_text(model, tok, ["abc"], max_new_tokens=5) == ["zzzzz"]


class _Always(torch.nn.Module):
    """An output head that always predicts one token."""

    def __init__(self, token: int) -> None:
        super().__init__()
        self.token = token

    def forward(self, h):
        logits = h.new_zeros(*h.shape[:-1], 260)
        logits[..., self.token] = 1.0
        return logits


# ---- loading checkpoints -------------------------------------------------------------------------------------------


def _fit_and_save(rank: int, world_size: int, ckpt_dir: str, ckpt_file: str) -> dict:
    """2-rank ep=2 fit of one step, then a distributed checkpoint (directory) and a full one (file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_moe import MoELanguageModel, MoEParallelStrategy

    L.seed_everything(3)
    model = MoELanguageModel(small_config(), warmup_steps=0, lr=1e-2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEParallelStrategy(ep=2), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(model, datamodule=FixedData(4, 8))
    trainer.save_checkpoint(ckpt_dir)
    trainer.strategy._save_distributed_checkpoint = False  # the same run as one full file on rank 0
    trainer.save_checkpoint(ckpt_file)
    full = get_model_state_dict(model.model, options=StateDictOptions(full_state_dict=True))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in full.items()}


def test_load_distributed_and_full_checkpoints_of_an_ep2_run(tmp_path):
    ckpt_dir, ckpt_file = tmp_path / "dcp", tmp_path / "full.ckpt"
    ref = run_distributed(_fit_and_save, 2, str(ckpt_dir), str(ckpt_file))
    assert (ckpt_dir / "meta.pt").is_file() and (ckpt_dir / ".metadata").is_file()
    assert len(list(ckpt_dir.glob("*.distcp"))) == 2
    fresh = MoETransformer(small_config()).state_dict()
    outs = []
    for path in (ckpt_dir, ckpt_file):
        model, cfg = load_for_generation(path)
        assert cfg == small_config()
        got = model.state_dict()
        assert set(got) == set(ref)
        for k, v in ref.items():
            assert torch.equal(got[k], v), (path, k)
        assert not model.training and not any(p.requires_grad for p in model.parameters())
        outs.append(generate(model, tokens((2, 5)), max_new_tokens=5))
    assert torch.equal(outs[0], outs[1])
    # the comparison is not trivial: trained experts and expert biases differ from a fresh model
    assert not torch.equal(ref["layers.1.moe.experts.w1"], fresh["layers.1.moe.experts.w1"])
    assert ref["layers.1.moe.router.expert_bias"].abs().max() > 0
    # a target dtype; routers stay fp32
    model, _ = load_for_generation(ckpt_dir, dtype=torch.bfloat16)
    assert model.layers["1"].moe.experts.w1.dtype == torch.bfloat16
    assert model.layers["1"].moe.router.weight.dtype == torch.float32
    assert torch.equal(model.layers["1"].moe.router.weight, ref["layers.1.moe.router.weight"])
    assert generate(model, tokens((2, 5)), max_new_tokens=3).shape == (2, 8)  # bf16 decoding runs


class _NotAllowed:
    pass


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory):
    """A one-process Lightning .ckpt after one training step, and the trained weights."""
    from lightning_moe import MoELanguageModel

    path = tmp_path_factory.mktemp("single") / "model.ckpt"
    L.seed_everything(4)
    cfg = make_config("mla")
    module = MoELanguageModel(cfg, warmup_steps=0, lr=1e-2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=FixedData(4, 4))
    trainer.save_checkpoint(path)
    return path, cfg, {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def test_load_single_file_checkpoint(single_ckpt):
    path, cfg, ref = single_ckpt
    model, got_cfg = load_for_generation(str(path))
    assert got_cfg == cfg
    got = model.state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], v) for k, v in ref.items())
    # non-persistent buffers are rebuilt: the loaded model computes what the trained one does
    trained = MoETransformer(cfg)
    trained.load_state_dict(ref)
    ids = tokens((2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), trained.eval()(ids), rtol=0, atol=0)


def test_load_errors(tmp_path, single_ckpt):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_for_generation(tmp_path / "missing.ckpt")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="not a distributed Lightning checkpoint"):
        load_for_generation(tmp_path / "empty_dir")
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="cannot read"):
        load_for_generation(tmp_path / "text.ckpt")
    # a pickle that would build an arbitrary object is refused, not executed
    torch.save({"state_dict": {}, "hyper_parameters": {"config": _NotAllowed()}}, tmp_path / "code.ckpt")
    with pytest.raises(ValueError, match="weights-only"):
        load_for_generation(tmp_path / "code.ckpt")
    torch.save({"state_dict": {"model.x": torch.zeros(1)}}, tmp_path / "nohp.ckpt")
    with pytest.raises(ValueError, match="hyper_parameters"):
        load_for_generation(tmp_path / "nohp.ckpt")
    path, cfg, ref = single_ckpt
    bad = {k: v for k, v in ref.items() if "layers.2" not in k}
    torch.save({"state_dict": {"model." + k: v for k, v in bad.items()},
                "hyper_parameters": {"config": cfg.to_dict()}}, tmp_path / "partial.ckpt")
    with pytest.raises(ValueError, match="does not match its own config"):
        load_for_generation(tmp_path / "partial.ckpt")


# ---- command line -------------------------------------------------------------------------------------------------


def test_generate_main(single_ckpt, capsys):
    path, cfg, _ = single_ckpt
    rc = generate_main(["--ckpt_path", str(path), "--prompt", "import os", "--prompt", "x", "--max_new_tokens", "5"])
    out = capsys.readouterr().out
    assert rc == 0
    model, _ = load_for_generation(path)
    texts = generate_text(model, ByteTokenizer(), ["import os", "x"], max_new_tokens=5)
    assert out == f"import os{texts[0]}\n\nx{texts[1]}\n"
    # sampling with a seed is reproducible through the command line
    args = ["--ckpt_path", str(path), "--prompt", "a", "--max_new_tokens", "8", "--temperature", "1.0",
            "--top_p", "0.95", "--seed", "7"]
    assert generate_main(args) == 0 and generate_main(args) == 0
    first, second = capsys.readouterr().out.split("\n")[:2]
    assert first == second


@pytest.mark.parametrize("argv, msg", [
    (["--ckpt_path", "/nonexistent/x.ckpt", "--prompt", "a"], "does not exist"),
    (["--prompt", "a"], "--ckpt_path"),
    (["--ckpt_path", "CKPT"], "--prompt"),
    (["--ckpt_path", "CKPT", "--prompt", "a", "--temperature", "-1"], "temperature"),
    (["--ckpt_path", "CKPT", "--prompt", "a", "--top_p", "2"], "top_p"),
    (["--ckpt_path", "CKPT", "--prompt", "a", "--max_new_tokens", "x"], "max_new_tokens"),
    (["--ckpt_path", "CKPT", "--prompt", "a", "--max_new_tokens", "100"], "max_seq_len"),
    (["--ckpt_path", "CKPT", "--prompt", "a", "--tokenizer", "/nonexistent/tok"], "does not exist"),
    (["--ckpt_path", "CKPT", "--prompt", "a", "--bogus"], "unrecognized"),
])
def test_generate_main_errors(single_ckpt, capsys, argv, msg):
    argv = [str(single_ckpt[0]) if a == "CKPT" else a for a in argv]
    assert generate_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-moe generate: error:") and msg in lines[0], captured.err
