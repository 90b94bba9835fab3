"""Hugging Face import/export: logits of tiny random transformers models match ours, both ways; bad input is a clear
ValueError; an ep=2 import on 2 gloo ranks reads only each rank's experts.

One piece (about 680 lines): every family's import and export uses the same tiny random model builders and logits
comparison, which the ep=2 import reuses."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from transformers import AutoConfig, AutoModelForCausalLM  # the "test" extra installs transformers>=5

from _dist import run_distributed
from lightning_moe.config import ModelConfig, MoEConfig, YaRNScaling
from lightning_moe.models.hf import (
    HFCheckpointReader,
    _config_differences,
    config_from_hf,
    config_to_hf,
    from_hf,
    load_hf_config,
    load_hf_state_dict_,
    load_hf_weights_,
    save_hf,
)
from lightning_moe.models.transformer import MoETransformer

V = 97
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 5000.0}

# One tiny model per family, each covering the family's features (initializer_range 0.1: routing is not near-uniform)
FAMILIES = {
    # explicit head_dim != hidden/heads, a dense layer in the middle (mlp_only_layers), normalised top-k, YaRN given in
    # transformers 5's rope_parameters spelling, and a sharded checkpoint
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=128,
        rope_parameters=dict(_YARN, mscale_all_dim=None, mscale=None), rms_norm_eps=1e-5,
    ),
    # tied embeddings, top-k over logits then softmax, default theta 1e6
    "mixtral": dict(
        model_type="mixtral", vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=True, max_position_embeddings=64,
    ),
    # qk-norm over all heads, un-normalised top-k
    "olmoe": dict(
        model_type="olmoe", vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
        eos_token_id=None, pad_token_id=None, max_position_embeddings=64, rope_theta=20000.0,
    ),
    # MLA with q-lora and interleaved rope, YaRN in the old rope_scaling spelling, first-k-dense, shared experts,
    # group-limited sigmoid routing with a non-zero e_score_correction_bias, routed_scaling_factor
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, n_shared_experts=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
        max_position_embeddings=128, rope_theta=5000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    ),
    # no query compression, no rope interleave, plain rope, no groups
    "deepseek_v3_plain": dict(
        model_type="deepseek_v3", vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_group=1,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, rope_interleave=False,
        routed_scaling_factor=1.0, max_position_embeddings=64,
    ),
}


def _hf_model(name: str, seed: int = 0):
    kw = dict(FAMILIES[name])
    mt = kw.pop("model_type")
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(mt, initializer_range=0.1, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)  # large enough to change the choice (sigmoid scores lie in (0, 1))
    return model


def _save(model, path, name: str) -> str:
    model.save_pretrained(path, max_shard_size="40KB" if name in ("qwen3_moe", "deepseek_v3") else "50MB")
    return str(path)


def _ids(seed: int = 1, B: int = 2, S: int = 24) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (a - b).norm() <= 1e-4 * b.norm()


# ---- import ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_logits_match_transformers(name, tmp_path):
    hf = _hf_model(name)
    path = _save(hf, tmp_path, name)
    if name in ("qwen3_moe", "deepseek_v3"):
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # sharded case
    model = from_hf(path).eval()
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)
    _close(got, want)

    # transformers 5's in-memory state dict holds fused gate_up_proj / down_proj experts: same result
    if name in ("qwen3_moe", "deepseek_v3"):
        sd = hf.state_dict()
        assert any(k.endswith("experts.gate_up_proj") for k in sd)
        fused = MoETransformer(model.config)
        load_hf_state_dict_(fused, sd, hf.config.to_dict())
        with torch.no_grad():
            _close(fused.eval()(ids), want)


def test_import_config_fields():
    q = config_from_hf(load_hf_config_dict("qwen3_moe"))
    assert q.head_dim == 16 and q.qk_norm == "head" and q.norm_eps == 1e-5 and q.max_seq_len == 128
    assert [q.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert q.moe.norm_topk_prob and q.moe.pre_softmax and q.rope_theta == 5000.0 and q.rope_scaling is not None
    m = config_from_hf(load_hf_config_dict("mixtral"))
    assert m.tie_embeddings and not m.moe.pre_softmax and m.rope_theta == 1e6 and m.moe.expert_hidden_size == 16
    o = config_from_hf(load_hf_config_dict("olmoe"))
    assert o.qk_norm == "full" and not o.moe.norm_topk_prob and o.moe.top_k == 3 and o.rope_theta == 20000.0
    d = config_from_hf(load_hf_config_dict("deepseek_v3"))
    assert d.attention == "mla" and d.q_lora_rank == 16 and d.moe.first_k_dense == 1
    assert (d.moe.num_groups, d.moe.group_topk, d.moe.scaling_factor) == (4, 2, 2.5)
    assert d.moe.expert_bias and d.moe.score_func == "sigmoid" and d.moe.shared_expert_hidden_size == 32
    assert d.rope_scaling == YaRNScaling(factor=4.0, original_max_position_embeddings=32, mscale=1.0,
                                         mscale_all_dim=0.8)
    p = config_from_hf(load_hf_config_dict("deepseek_v3_plain"))
    assert p.q_lora_rank is None and p.moe.num_groups is None and p.moe.scaling_factor is None

    # both RoPE spellings give one config
    base = dict(model_type="deepseek_v3", num_hidden_layers=2, rope_theta=5000.0, max_position_embeddings=128)
    y = {k: v for k, v in _YARN.items() if k not in ("rope_theta",)}
    old = config_from_hf(dict(base, rope_scaling=dict(y, type="yarn")))
    new = config_from_hf(dict(base, rope_parameters=dict(y, rope_theta=5000.0)))
    assert old == new and old.rope_theta == 5000.0

    # decoder_sparse_step: every second layer is sparse (transformers: (i + 1) % step == 0), minus mlp_only_layers
    s = config_from_hf(dict(model_type="qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [s.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert s.moe.first_k_dense == 1 and s.moe.dense_layers == [2, 3, 4]
    # overrides replace fields after the mapping
    assert config_from_hf(dict(model_type="mixtral"), max_seq_len=128, moe={"aux_loss_coeff": 0.0}).max_seq_len == 128


def load_hf_config_dict(name: str) -> dict:
    """The config.json transformers writes for FAMILIES[name] (through its own serialisation)."""
    kw = dict(FAMILIES[name])
    mt = kw.pop("model_type")
    d = AutoConfig.for_model(mt, **kw).to_dict()
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("hf, field", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=128), "use_sliding_window"),
    (dict(model_type="mixtral", sliding_window=4096), "sliding_window"),
    (dict(model_type="qwen3_moe", attention_bias=True), "attention_bias"),
    (dict(model_type="olmoe", clip_qkv=8.0), "clip_qkv"),
    (dict(model_type="mixtral", hidden_act="gelu"), "hidden_act"),
    (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(model_type="qwen3_moe", rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type"),
    (dict(model_type="qwen3_moe", partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(model_type="deepseek_v3", quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(model_type="deepseek_v3", num_experts_per_tok=6, topk_group=2), "topk_group"),
    (dict(model_type="deepseek_v3", num_attention_heads=8, num_key_value_heads=2), "num_key_value_heads"),
    (dict(model_type="deepseek_v3", rms_norm_eps=1e-5), "rms_norm_eps"),
    (dict(model_type="olmoe", hidden_size=64, num_attention_heads=4, head_dim=32), "head_dim"),
    (dict(model_type="mixtral", attention_dropout=0.1), "attention_dropout"),
])
def test_unsupported_config_is_a_value_error(hf, field):
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf)


def _rewrite(path: str, change) -> None:
    """Rewrite a single-file checkpoint's tensors with ``change(dict)``."""
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    change(sd)
    save_file(sd, f, metadata={"format": "pt"})


def test_missing_extra_and_mtp_tensors(tmp_path):
    hf = _hf_model("deepseek_v3_plain")
    path = _save(hf, tmp_path / "a", "deepseek_v3_plain")
    cfg = config_from_hf(load_hf_config(path))

    # DeepSeek-V3 multi-token-prediction layers (index >= num_hidden_layers) are skipped, logged
    _rewrite(path, lambda sd: sd.update({"model.layers.2.eh_proj.weight": torch.zeros(4, 4),
                                         "model.layers.2.enorm.weight": torch.ones(4)}))
    model = MoETransformer(cfg)
    res = load_hf_weights_(model, path)
    assert sorted(res.skipped) == ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"]
    with torch.no_grad():
        _close(model.eval()(_ids()), hf(_ids()).logits)

    # an unknown tensor: named
    _rewrite(path, lambda sd: sd.update({"model.layers.0.mlp.mystery.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"no place for.*model\.layers\.0\.mlp\.mystery\.weight"):
        load_hf_weights_(MoETransformer(cfg), path)
    res = load_hf_weights_(MoETransformer(cfg), path, strict=False)
    assert res.unexpected == ["model.layers.0.mlp.mystery.weight"]

    # a missing expert: named (experts are never left random)
    _rewrite(path, lambda sd: sd.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_hf_weights_(MoETransformer(cfg), path)

    # a tensor of the wrong shape: named
    _rewrite(path, lambda sd: sd.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_hf_weights_(MoETransformer(cfg), path, strict=False)


def test_config_mismatch_and_pickle_refused(tmp_path):
    hf = _hf_model("olmoe")
    path = _save(hf, tmp_path / "a", "olmoe")
    cfg = config_from_hf(load_hf_config(path))
    other = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, norm_topk_prob=True))
    with pytest.raises(ValueError, match="norm_topk_prob"):
        load_hf_weights_(MoETransformer(other), path)
    # a pickle checkpoint is never opened
    os.makedirs(tmp_path / "bin")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"not opened")
    (tmp_path / "bin" / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(ValueError, match="pickle"):
        load_hf_weights_(MoETransformer(cfg), tmp_path / "bin")
    # an index naming a file outside the folder
    os.makedirs(tmp_path / "evil")
    (tmp_path / "evil" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../a/model.safetensors"}}))
    with pytest.raises(ValueError, match="plain file name"):
        HFCheckpointReader(tmp_path / "evil")


def test_reader_reads_only_the_box(tmp_path):
    hf = _hf_model("mixtral")
    path = _save(hf, tmp_path, "mixtral")
    with HFCheckpointReader(path) as r:
        key = "model.embed_tokens.weight"
        assert r.shape(key) == (V, 32)
        t = r.read(key, (slice(10, 20), slice(0, 32)))
        torch.testing.assert_close(t, hf.state_dict()[key][10:20])
        assert r.bytes_read == 10 * 32 * 4 and r.bytes_by_key == {key: 10 * 32 * 4}


def test_deepseek_bias_used_for_choice_only(tmp_path):
    """transformers' DeepSeek-V3 adds e_score_correction_bias to the scores for the choice, and weights the chosen
    experts by the unbiased scores -- as our router does. The bias matters (zeroing it changes the logits)."""
    hf = _hf_model("deepseek_v3")
    model = from_hf(_save(hf, tmp_path, "deepseek_v3")).eval()
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        _close(model(ids), want)
        for layer in model.moe_layers():
            layer.router.expert_bias.zero_()
        assert (model(ids) - want).abs().max() > 1e-3


# ---- export ---------------------------------------------------------------------------------------------------------

EXPORT = {
    "qwen3_moe": ModelConfig(
        vocab_size=V, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, dense_hidden_size=48,
        max_seq_len=64, qk_norm="head", init_std=0.1,
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden_size=16, first_k_dense=1, dense_layers=[2])),
    "mixtral": ModelConfig(
        vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64, init_std=0.1,
        tie_embeddings=True, rope_theta=1e6, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden_size=16,
                                                           pre_softmax=False)),
    "olmoe": ModelConfig(
        vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64, init_std=0.1,
        qk_norm="full", moe=MoEConfig(num_experts=8, top_k=2, expert_hidden_size=16, norm_topk_prob=False)),
    "deepseek_v3": ModelConfig(
        vocab_size=V, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=4, dense_hidden_size=48,
        max_seq_len=128, init_std=0.1, attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8,
        rope_scaling=YaRNScaling(factor=4.0, original_max_position_embeddings=32, mscale=0.9, mscale_all_dim=0.0),
        moe=MoEConfig(num_experts=8, top_k=4, expert_hidden_size=16, score_func="sigmoid", scaling_factor=2.5,
                      num_groups=4, group_topk=2, expert_bias=True, shared_expert_hidden_size=32, first_k_dense=1)),
}


@pytest.mark.parametrize("model_type", list(EXPORT))
def test_export_loads_in_transformers_with_same_logits(model_type, tmp_path):
    cfg = EXPORT[model_type]
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    model.init_weights()
    with torch.no_grad():
        for layer in model.moe_layers():
            if layer.router.expert_bias is not None:
                layer.router.expert_bias.normal_(0.0, 0.5)
    out = tmp_path / "out"
    shard = 30_000 if model_type in ("qwen3_moe", "deepseek_v3") else 10**9
    files = save_hf(model, out, model_type=model_type, max_shard_bytes=shard)
    assert ("model.safetensors.index.json" in files) == (shard < 10**9)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == model_type and written["architectures"] == [config_to_hf(cfg, model_type)
                                                                                 ["architectures"][0]]
    hf, info = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = _ids()
    with torch.no_grad():
        _close(hf.eval()(ids).logits, model.eval()(ids))
    # and back: the same tensors, a config that computes the same
    back = from_hf(out)
    assert not _config_differences(back.config, cfg)
    assert back.config.rope_scaling == cfg.rope_scaling and back.config.rope_theta == cfg.rope_theta
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)


def test_export_refuses_what_the_family_cannot_express(tmp_path):
    with pytest.raises(ValueError, match="shared experts"):
        config_to_hf(dataclasses.replace(EXPORT["olmoe"], moe=dataclasses.replace(
            EXPORT["olmoe"].moe, shared_expert_hidden_size=16)), "olmoe")
    with pytest.raises(ValueError, match="qk_norm"):
        config_to_hf(EXPORT["olmoe"], "mixtral")
    with pytest.raises(ValueError, match="dense layers"):
        config_to_hf(dataclasses.replace(EXPORT["deepseek_v3"], moe=dataclasses.replace(
            EXPORT["deepseek_v3"].moe, first_k_dense=0, dense_layers=[1])), "deepseek_v3")
    # a failed export leaves an existing folder untouched
    out = tmp_path / "keep"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(ValueError):
        save_hf(MoETransformer(EXPORT["olmoe"]), out, model_type="mixtral")
    assert (out / "config.json").read_text() == "{}"


# ---- 2 ranks, ep=2 --------------------------------------------------------------------------------------------------


def _ep_worker(rank: int, world_size: int, path: str, out: str, model_type: str, sizes: dict) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_moe.parallel import ParallelDims, parallelize

    cfg = config_from_hf(load_hf_config(path))
    dims = ParallelDims(world_size=world_size, **sizes).build_meshes("cpu")
    with torch.device("meta"):
        model = MoETransformer(cfg)
    parallelize(model, dims)
    model.to_empty(device="cpu")
    res = load_hf_weights_(model, path)

    # every local shard equals the matching box of the one-process import
    ref = from_hf(path)
    ref_sd = ref.state_dict()
    placements = set()
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            placements.add(tuple(map(str, t.placements)))
            t = t.full_tensor()
        torch.testing.assert_close(t, ref_sd[name], rtol=0, atol=0, msg=name)
    ids = _ids()
    with torch.no_grad():
        logits = model.eval()(ids)
        ref_logits = ref.eval()(ids)

    expert_total = 0
    with HFCheckpointReader(path) as r:
        for k in r.keys():
            if ".experts." in k:
                expert_total += 4 * torch.Size(r.shape(k)).numel()
    expert_read = sum(n for k, n in res.bytes_by_key.items() if ".experts." in k)
    save_hf(model, out, model_type=model_type)  # DTensors gathered; rank 0 writes
    return dict(expert_read=expert_read, expert_total=expert_total, total_read=res.bytes_read,
                placements=placements, logits=logits, ref_logits=ref_logits,
                ep_local=tuple(model.moe_layers()[0].experts.w1.to_local().shape))


def _ep_rank_reads(rank: int, world_size: int, path: str, out: str, model_type: str, sizes: dict) -> dict:
    result = _ep_worker(rank, world_size, path, out, model_type, sizes)
    import torch.distributed as dist

    gathered = [None] * world_size
    dist.all_gather_object(gathered, (result["expert_read"], result["total_read"]))
    result["reads"] = gathered
    return result


@pytest.mark.parametrize("name, sizes, placements", [
    # ep=2 folded over dp_shard=2: experts Shard(0) over ep, everything else FSDP Shard(0)
    ("deepseek_v3", dict(ep=2), {("S(0)",)}),
    # ep=2 folded over tp=2: attention / dense MLP / shared linears Shard(0) or Shard(1) over tp
    ("qwen3_moe", dict(tp=2, ep=2), {("S(0)",), ("S(1)",), ("R",)}),
    # MLA under tp=2: the up-projections' rows (heads, with DeepSeek's interleaved rope rows) Shard(0) over tp
    ("deepseek_v3", dict(tp=2, ep=2), {("S(0)",), ("S(1)",), ("R",)}),
])
def test_ep2_import_reads_only_local_experts(name, sizes, placements, tmp_path):
    """2 gloo ranks: each rank's shards equal the one-process import, logits match transformers, each rank reads
    about half of the expert bytes, and the export gathered from the shards loads in transformers."""
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path / "hf")
    out = str(tmp_path / "export")
    res = run_distributed(_ep_rank_reads, 2, str(tmp_path / "hf"), out, FAMILIES[name]["model_type"], sizes)
    assert res["ep_local"] == (FAMILIES[name].get("n_routed_experts", FAMILIES[name].get("num_experts")) // 2, 16, 32)
    assert placements <= res["placements"], res["placements"]
    _close(res["logits"], res["ref_logits"])
    with torch.no_grad():
        _close(res["logits"], hf(_ids()).logits)
    total = res["expert_total"]
    for expert_read, total_read in res["reads"]:
        assert 0 < expert_read < 0.6 * total, (expert_read, total)
    # the export written from DTensor shards loads in transformers with the same logits
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        _close(back(_ids()).logits, hf(_ids()).logits)


def test_safetensors_files_are_what_transformers_writes(tmp_path):
    """Our export's per-expert keys are exactly those of transformers' own save_pretrained."""
    for mt in ("mixtral", "deepseek_v3"):
        model = MoETransformer(EXPORT[mt])
        model.init_weights()
        save_hf(model, tmp_path / mt, model_type=mt)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / mt)
        hf.save_pretrained(tmp_path / (mt + "_hf"))
        keys = {}
        for d in (mt, mt + "_hf"):
            with safe_open(str(tmp_path / d / "model.safetensors"), "pt") as f:
                keys[d] = set(f.keys())
        assert keys[mt] == keys[mt + "_hf"]


# ---- moe.dense_layers (the config field Qwen3-MoE's mlp_only_layers / decoder_sparse_step map to) -------------------


def test_dense_layers_config():
    base = ModelConfig.from_preset("tiny")
    assert base.moe.dense_layers is None
    cfg = ModelConfig.from_preset("tiny", num_layers=5, moe={"first_k_dense": 1, "dense_layers": [3]})
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, True, True, False, True]
    assert cfg.num_moe_layers == 3
    model = MoETransformer(cfg)
    assert [blk.is_moe for blk in model.layers.values()] == [False, True, True, False, True]
    assert sum(p.numel() for p in model.parameters()) == cfg.count_params()["total"]
    # a preset's parameter count does not change with dense_layers=None / []
    d = ModelConfig.from_preset("deepseek_v3")
    assert d.count_params() == ModelConfig.from_preset("deepseek_v3", moe={"dense_layers": []}).count_params()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    for bad, match in [([5], "past num_layers"), ([-1], "non-negative"), ([2, 2], "repeated")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_preset("tiny", num_layers=5, moe={"dense_layers": bad})


# ---- the LightningModule: from_pretrained / pretrained= / save_pretrained ----------------------------------------------


def test_module_from_pretrained_fine_tunes_and_saves(tmp_path):
    """MoELanguageModel.from_pretrained builds through the pipeline with the folder's weights (logits equal
    transformers'), fine-tunes under a Trainer, and save_pretrained writes a folder transformers loads."""
    import lightning as L

    from lightning_moe import MoELanguageModel

    hf = _hf_model("qwen3_moe")
    path = _save(hf, tmp_path / "src", "qwen3_moe")
    module = MoELanguageModel.from_pretrained(path, lr=1e-3, warmup_steps=0)
    assert module.hparams.pretrained == path and module.config.moe.num_experts == hf.config.num_experts
    module.configure_model()
    ids = _ids()
    with torch.no_grad():
        _close(module(ids), hf(ids).logits)

    class Data(L.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([{"input_ids": r} for r in _ids(seed=3, B=4)], batch_size=2)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(module, Data())
    out = tmp_path / "out"
    module.save_pretrained(str(out))
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        tuned = module(ids)
        _close(tuned, back(ids).logits)
        assert (tuned - hf(ids).logits).abs().max() > 1e-4, "fine-tuning changed nothing"
    # a config that contradicts the folder is refused, naming the field
    with pytest.raises(ValueError, match="num_layers"):
        bad = MoELanguageModel(config=dict(module.config.to_dict(), num_layers=1), pretrained=path)
        bad.configure_model()


def test_export_command_from_a_distributed_checkpoint(tmp_path):
    """`lightning-moe export CHECKPOINT OUT_DIR` turns a checkpoint of any layout (here an ep=2 distributed
    checkpoint) into a folder transformers loads with the same logits."""
    from _dist import run_distributed

    from lightning_moe.export import export_main
    from lightning_moe.generation import load_for_generation

    ckpt = str(tmp_path / "ep2.ckpt")
    run_distributed(_save_ep2_checkpoint, 2, ckpt)
    out = tmp_path / "hf"
    assert export_main([ckpt, str(out), "--max_shard_size", "200KB"]) == 0
    assert (out / "model.safetensors.index.json").exists()
    ours, _ = load_for_generation(ckpt)
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids()
    with torch.no_grad():
        _close(ours(ids), back(ids).logits)
    assert export_main([str(tmp_path / "missing"), str(tmp_path / "x")]) == 2


def _save_ep2_checkpoint(rank: int, world_size: int, path: str) -> None:
    import lightning as L
    from parallel_harness import GLOBAL_BATCH, FixedData, small_config

    from lightning_moe import MoELanguageModel, MoEParallelStrategy

    # a Qwen3-MoE-expressible config: softmax routing, no shared expert (the first layer dense)
    cfg = small_config(score_func="softmax", expert_bias=False, shared_expert_hidden_size=0, aux_loss_type="aux")
    model = MoELanguageModel(cfg, warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEParallelStrategy(ep=2), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH))
    trainer.save_checkpoint(path)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_dense_import_and_upcycling_from_a_hugging_face_folder(model_type, tmp_path):
    """Dense qwen3 / llama folders import with transformers' logits, and MoELanguageModel.upcycle(folder, ...) gives an
    MoE model whose logits at init equal the dense model's."""
    from lightning_moe import MoEConfig, MoELanguageModel
    from lightning_moe.models.hf import from_hf

    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, head_dim=16, initializer_range=0.1)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **kw)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path / "dense")
    ids = _ids()
    ours = from_hf(tmp_path / "dense")
    assert ours.config.moe.num_experts == 0 and ours.config.qk_norm == ("head" if model_type == "qwen3" else "none")
    with torch.no_grad():
        want = hf(ids).logits
        _close(ours(ids), want)
    up = MoELanguageModel.upcycle(str(tmp_path / "dense"), MoEConfig(num_experts=4, top_k=2, expert_hidden_size=48,
                                                                       aux_loss_coeff=0.0), granularity=2)
    up.configure_model()
    assert len(up.model.moe_layers()) == 2
    with torch.no_grad():
        _close(up(ids), want)
    with pytest.raises(ValueError, match="cannot be exported"):
        up.save_pretrained(str(tmp_path / "out"), model_type=model_type)


def test_cli_fine_tunes_from_a_hugging_face_folder(tmp_path, capsys):
    """`model: {pretrained: PATH}` in a fit YAML: the config comes from the folder and its weights are loaded."""
    import yaml
    from _cli import run_cli

    path = _save_qwen3_moe_with_byte_vocab(tmp_path / "src")  # the byte tokenizer's vocabulary
    cfg = {"trainer": {"accelerator": "cpu", "max_steps": 1, "limit_val_batches": 0, "enable_progress_bar": False,
                       "logger": False, "enable_checkpointing": False, "default_root_dir": str(tmp_path)},
           "model": {"pretrained": path, "lr": 1e-3, "warmup_steps": 0},
           "data": {"seq_len": 16, "batch_size": 2, "max_tokens": 5000}}
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(cfg))
    assert run_cli(["fit", "--config", str(tmp_path / "ft.yaml")]) == 0
    # a YAML whose model.config contradicts the folder is one clear line, exit 2
    cfg["model"]["config"] = {"preset": "tiny", "num_layers": 3}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    assert run_cli(["fit", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_fine_tune_the_main_config_from_a_folder_and_load_without_it(tmp_path, capsys):
    """`fit --config tiny.yaml --model.pretrained DIR`: tiny.yaml's bare preset gives way to the folder's config (so
    does `--model.config null`); the run's checkpoint is self-contained: it loads, with the fine-tuned weights, once
    the folder is gone."""
    import shutil

    from _cli import run_cli

    from lightning_moe import MoELanguageModel

    src = _save_qwen3_moe_with_byte_vocab(tmp_path / "src")
    tiny = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "tiny.yaml")
    args = ["fit", "--config", tiny, "--model.pretrained", src, "--data.seq_len=16", "--data.batch_size=2",
            "--data.max_tokens=5000", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false"]
    assert run_cli(args + ["--model.config", "null", f"--trainer.default_root_dir={tmp_path / 'null'}"]) == 0
    assert run_cli(args + [f"--trainer.default_root_dir={tmp_path / 'run'}"]) == 0
    assert f"model.config comes from {src}/config.json (model.pretrained), not the preset 'tiny'" in \
        capsys.readouterr().err
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")
    start = from_hf(src).state_dict()
    shutil.rmtree(src)
    module = MoELanguageModel.load_from_checkpoint(ckpt, weights_only=True)  # no folder needed
    assert module.hparams.pretrained is None
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    assert all(torch.equal(module.state_dict()[k], v) for k, v in saved.items())
    # fine-tuned from the folder's weights (2 small steps), not from a fresh initialisation
    moved = max(float((saved["model." + k] - v).abs().max()) for k, v in start.items())
    assert 0 < moved < 1e-2, moved


def _save_qwen3_moe_with_byte_vocab(path) -> str:
    torch.manual_seed(0)
    hf_cfg = AutoConfig.for_model("qwen3_moe", vocab_size=260, hidden_size=64, intermediate_size=96,
                                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                  max_position_embeddings=64, norm_topk_prob=True)
    AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(str(path))
    return str(path)


def test_a_truncated_safetensors_file_is_named(tmp_path):
    path = _save(_hf_model("mixtral"), tmp_path, "mixtral")
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read as safetensors .*incomplete"):
        from_hf(path)


def test_the_main_jobs_model_exports_and_reloads_in_transformers(tmp_path, capsys):
    """The README's main job (tiny.yaml, the tiny preset) -> `lightning-moe export CKPT OUT` with no --model_type ->
    transformers loads the folder with no missing or unexpected weights and computes the same logits. A model no
    family holds is refused naming, for each family, the field that stops it."""
    from _cli import run_cli

    from lightning_moe.export import export_main
    from lightning_moe.generation import load_for_generation

    tiny = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "tiny.yaml")
    assert run_cli(["fit", "--config", tiny, "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
                    "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={tmp_path}", "--data.seq_len=64",
                    "--data.batch_size=2", "--data.max_tokens=20000", "--trainer.enable_progress_bar=false",
                    "--trainer.logger=false"]) == 0
    (ckpt,) = tmp_path.rglob("*.ckpt")
    assert export_main([str(ckpt), str(tmp_path / "hf")]) == 0
    assert "(qwen3_moe," in capsys.readouterr().out
    ours, cfg = load_for_generation(ckpt)
    assert cfg == ModelConfig.from_preset("tiny")
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.randint(0, 260, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _close(hf.eval()(ids).logits, ours(ids))

    shared = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_expert_hidden_size=128))
    with pytest.raises(ValueError) as err:
        save_hf(MoETransformer(shared), tmp_path / "no", model_type="qwen3_moe")
    msg = str(err.value)
    assert msg.startswith("cannot export to qwen3_moe: moe.shared_expert_hidden_size=128") and \
        "No other family holds this model" in msg and "deepseek_v3: attention must be 'mla'" in msg and \
        "mixtral: " in msg and "olmoe: " in msg, msg
    with pytest.raises(ValueError, match=r"Families that hold this model: qwen3_moe \(model_type='qwen3_moe'\)"):
        save_hf(MoETransformer(cfg), tmp_path / "no", model_type="olmoe")
