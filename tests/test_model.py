"""MoETransformer: meta-device construction of the huge presets, forward/backward of GQA and MLA variants, causality,
right padding, tied embeddings, init_weights and the dense/MoE layer layout."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.config import ModelConfig, YaRNScaling
from lightning_moe.models.outputs import LMStepOutput
from lightning_moe.models.transformer import FeedForward, MoETransformer
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.record import MoERecorder

GiB = 1 << 30


# ---- memory guard --------------------------------------------------------------------------------------------------


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


@contextlib.contextmanager
def _address_space_limit(extra_bytes: int):
    """Caps the process's address space at (current virtual size + extra_bytes) for the duration, so an accidental
    real allocation of a huge model fails with a clean error instead of driving the machine out of memory."""
    try:
        import resource

        vm = _proc_status_kib("VmSize") * 1024
        old = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, RuntimeError):  # not Linux: no guard, the RSS assertion still runs
        yield
        return
    soft = vm + extra_bytes
    if old[1] != resource.RLIM_INFINITY:
        soft = min(soft, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe_235b_a22b"])
def test_meta_construction_of_huge_presets(name):
    import resource

    cfg = ModelConfig.from_preset(name)
    rss0 = _proc_status_kib("VmRSS") * 1024
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    with _address_space_limit(4 * GiB):
        with torch.device("meta"):
            model = MoETransformer(cfg)
    rss1 = _proc_status_kib("VmRSS") * 1024
    peak1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert rss1 - rss0 < GiB, f"RSS grew by {(rss1 - rss0) / GiB:.2f} GiB building {name} on meta"
    assert peak1 - peak0 < GiB, f"peak RSS grew by {(peak1 - peak0) / GiB:.2f} GiB building {name} on meta"

    not_meta = [n for n, p in model.named_parameters() if not p.is_meta]
    not_meta += [n for n, b in model.named_buffers() if b is not None and not b.is_meta]
    assert not not_meta, f"allocated tensors: {not_meta[:5]}"
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for k, b in model.named_buffers() if k.endswith("expert_bias"))
    assert n == cfg.count_params()["total"]
    assert n > 200e9  # really the huge model, not a shrunken one
    assert len(model.moe_layers()) == cfg.num_moe_layers


# ---- small configs -------------------------------------------------------------------------------------------------

SMALL_MOE = dict(num_experts=4, top_k=2, expert_hidden_size=32, first_k_dense=1, shared_expert_hidden_size=32,
                 aux_loss_type="aux", aux_loss_coeff=1e-2, z_loss_coeff=1e-3)


def _gqa(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                dense_hidden_size=48, max_seq_len=32, qk_norm="head", moe=dict(SMALL_MOE))
    base.update(kw)
    return ModelConfig(**base)


def _mla(q_lora_rank=None, **kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, dense_hidden_size=48,
                max_seq_len=64, attention="mla", qk_norm="none", q_lora_rank=q_lora_rank, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                rope_scaling=YaRNScaling(factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                                         mscale_all_dim=1.0),
                moe=dict(SMALL_MOE, score_func="sigmoid", expert_bias=True, aux_loss_type="seq",
                         scaling_factor=2.5, num_groups=2, group_topk=1))
    base.update(kw)
    return ModelConfig(**base)


def _build(cfg: ModelConfig, seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    model.init_weights()
    return model


def _fwd_bwd(model: MoETransformer, B: int = 2, S: int = 16):
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    recorder = MoERecorder()
    logits = model(ids, recorder=recorder)
    assert logits.shape == (B, S, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    aux = sum(r.aux_loss for r in recorder.records.values())
    z = sum(r.z_loss for r in recorder.records.values())
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) + aux + z
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    nonfinite = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not nonfinite, nonfinite
    zero = [n for n, p in model.named_parameters() if p.grad.abs().sum() == 0]
    assert not zero, f"zero gradient for {zero}"
    return logits


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_mla_forward_backward(q_lora_rank):
    cfg = _mla(q_lora_rank)
    model = _build(cfg)
    attn = model.layers["0"].attention
    assert type(attn).__name__ == "MLAttention"
    assert hasattr(attn, "wq") == (q_lora_rank is None)
    assert hasattr(attn, "wq_a") == (q_lora_rank is not None)
    # YaRN folds its temperature into the softmax scale: scale = mscale(factor, mscale_all_dim)^2 / sqrt(qk_dim)
    m = 0.1 * math.log(4.0) + 1.0
    assert attn.scale == pytest.approx(m * m / math.sqrt(16))
    _fwd_bwd(model)


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
def test_gqa_qk_norm_forward_backward(qk_norm):
    cfg = _gqa(qk_norm=qk_norm)
    model = _build(cfg)
    attn = model.layers["0"].attention
    if qk_norm == "head":
        assert attn.q_norm.weight.shape == (8,) and attn.k_norm.weight.shape == (8,)
    elif qk_norm == "full":
        assert attn.q_norm.weight.shape == (4 * 8,) and attn.k_norm.weight.shape == (2 * 8,)
    else:
        assert not hasattr(attn, "q_norm")
    _fwd_bwd(model)  # includes: the qk-norm weights get a non-zero gradient, so they are used


def test_qk_norm_head_normalises_per_head():
    # with qk_norm="head", scaling the query projection of one head does not change the output (RMSNorm undoes it)
    cfg = _gqa(qk_norm="head")
    model = _build(cfg)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        model.layers["1"].attention.wq.weight[8:16] *= 7.0  # head 1
        out = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    cfg = _gqa(qk_norm="none")  # control: without the norm the same change matters
    model = _build(cfg)
    with torch.no_grad():
        ref = model(ids)
        model.layers["1"].attention.wq.weight[8:16] *= 7.0
        out = model(ids)
    assert not torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_tied_embeddings():
    cfg = _gqa(tie_embeddings=True)
    model = _build(cfg)
    assert model.output is None
    assert not any(k.startswith("output") for k in model.state_dict())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    h = model.hidden_states(ids)
    logits = model(ids)
    torch.testing.assert_close(logits, h @ model.tok_embeddings.weight.T)
    # the embedding matrix receives the head's gradient too: rows of tokens never seen as inputs get a gradient
    logits.sum().backward()
    unseen = torch.ones(64, dtype=torch.bool)
    unseen[ids.flatten()] = False
    assert model.tok_embeddings.weight.grad[unseen].abs().sum() > 0
    untied = _build(_gqa())
    n_tied = sum(p.numel() for p in model.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 64 * 32


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_causal(kind):
    cfg = _gqa() if kind == "gqa" else _mla(q_lora_rank=24)
    model = _build(cfg).eval()
    S, j = 12, 7
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(0))
    ids2 = ids.clone()
    ids2[:, j] = (ids[:, j] + 1) % 64
    with torch.no_grad():
        a, b = model(ids), model(ids2)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-7)
    assert (a[:, j] - b[:, j]).abs().max() > 1e-4  # the changed position itself does change
    assert (a[:, j + 1 :] - b[:, j + 1 :]).abs().max() > 1e-5  # and later ones see it


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_right_padding_matches_unpadded(kind):
    cfg = _gqa() if kind == "gqa" else _mla()
    model = _build(cfg).eval()
    S, n = 16, 10
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, S), generator=g)
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, n:] = 0
    padded = ids.clone()
    padded[1, n:] = 0  # pad token id: any value
    with torch.no_grad():
        recorder = MoERecorder()
        out = model(padded, mask, recorder=recorder)
        # padding tokens are routed nowhere: the MoE layers count only real tokens
        assert len(recorder.records) == len(model.moe_layers())
        for rec in recorder.records.values():
            assert int(rec.routing.num_tokens) == S + n
            assert int(rec.routing.tokens_per_expert.sum()) == (S + n) * cfg.moe.top_k
        short = model(ids[1:, :n])
        full = model(ids[:1])
    assert torch.isfinite(out).all()  # fully padded query rows stay finite
    torch.testing.assert_close(out[1, :n], short[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[0], full[0], rtol=1e-4, atol=1e-5)


def test_all_ones_mask_equals_no_mask():
    model = _build(_gqa()).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.ones_like(ids)), model(ids))


def test_init_weights_stds():
    L, std = 4, 0.05
    cfg = ModelConfig.from_preset("tiny", num_layers=L, init_std=std,
                                  moe={"num_experts": 8, "expert_hidden_size": 128, "first_k_dense": 1,
                                       "shared_expert_hidden_size": 128})
    model = _build(cfg)
    out_std = std / math.sqrt(2 * L)
    # truncation at 3 sigma lowers the std by ~1.3%; estimates from >= 16k samples are good to ~1%
    tol = 0.08

    def check(t, expected, what):
        s = t.detach().float().std().item()
        assert abs(s - expected) / expected < tol, f"{what}: std {s:.5f}, expected {expected:.5f}"

    dense = model.layers["0"]
    moe = model.layers["1"]
    assert not dense.is_moe and moe.is_moe
    for blk in (dense, moe):
        check(blk.attention.wq.weight, std, "wq")
        check(blk.attention.wk.weight, std, "wk")
        check(blk.attention.wo.weight, out_std, "wo (residual out)")
    check(dense.feed_forward.w1.weight, std, "dense w1")
    check(dense.feed_forward.w3.weight, std, "dense w3")
    check(dense.feed_forward.w2.weight, out_std, "dense w2 (residual out)")
    check(moe.moe.experts.w1, std, "expert w1")
    check(moe.moe.experts.w3, std, "expert w3")
    check(moe.moe.experts.w2, out_std, "expert w2 (residual out)")
    check(moe.moe.shared_experts.w1.weight, std, "shared w1")
    check(moe.moe.shared_experts.w2.weight, out_std, "shared w2 (residual out)")
    check(moe.moe.router.weight, std, "router")
    check(model.output.weight, std, "output head")
    # embeddings at init_std, as Hugging Face initialises these families (documented in init_weights)
    check(model.tok_embeddings.weight, std, "embedding")
    assert torch.equal(dense.attention_norm.weight, torch.ones(cfg.hidden_size))


def test_meta_then_materialise():
    # the configure_model path: build on meta, to_empty, init_weights -> finite, rope tables rebuilt
    cfg = _mla(q_lora_rank=24)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    ref = _build(cfg)
    torch.testing.assert_close(model.layers["0"].attention.rope.cos_sin, ref.layers["0"].attention.rope.cos_sin)
    for layer in model.moe_layers():
        assert torch.equal(layer.router.expert_bias, torch.zeros(cfg.moe.num_experts))
    _fwd_bwd(model)


def test_first_k_dense_layout():
    cfg = _gqa(num_layers=4, moe=dict(SMALL_MOE, first_k_dense=2))
    model = _build(cfg)
    kinds = [(blk.is_moe, isinstance(getattr(blk, "moe", None), MoELayer),
              isinstance(getattr(blk, "feed_forward", None), FeedForward)) for blk in model.layers.values()]
    assert kinds == [(False, False, True)] * 2 + [(True, True, False)] * 2
    keys = model.state_dict().keys()
    assert "layers.0.feed_forward.w1.weight" in keys and "layers.2.moe.experts.w1" in keys
    assert not any(k.startswith("layers.1.moe") for k in keys)
    assert not any(k.startswith("layers.3.feed_forward") for k in keys)
    assert len(model.moe_layers()) == 2
    # a dense model (num_experts=0) has no MoE layer and zero MoE losses
    dense = _build(_gqa(moe=dict(SMALL_MOE, num_experts=0)))
    assert dense.moe_layers() == []
    ids = torch.zeros(1, 4, dtype=torch.long)
    out = dense(ids, labels_BS=ids)
    assert out.moe == {} and float(out.aux_loss) == 0.0 and float(out.z_loss) == 0.0


def test_step_output_sums_the_layers_records():
    """The training forward's LMStepOutput: the loss sum and valid labels, and one record per MoE layer whose
    losses are the layers' own (the same numbers as a logits forward with a recorder) and sum into aux / z."""
    model = _build(_gqa(num_layers=3, moe=dict(SMALL_MOE, first_k_dense=0)))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels_BS=labels, loss_impl="torch")
    assert isinstance(out, LMStepOutput)
    assert sorted(out.moe) == [0, 1, 2] and int(out.num_tokens) == 2 * 8 - 3
    logits = model(ids)
    torch.testing.assert_close(out.loss_sum, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
    torch.testing.assert_close(out.aux_loss, sum(r.aux_loss for r in out.moe.values()))
    torch.testing.assert_close(out.z_loss, sum(r.z_loss for r in out.moe.values()))
    assert out.aux_loss.item() > 0 and out.z_loss.item() > 0 and out.aux_loss.requires_grad
    recorder = MoERecorder()
    model(ids, recorder=recorder)
    for i, rec in out.moe.items():
        torch.testing.assert_close(rec.aux_loss, recorder.records[i].aux_loss)
        assert torch.equal(rec.routing.tokens_per_expert, recorder.records[i].routing.tokens_per_expert)
