"""Selective recomputation (activation_checkpointing=[kinds]) and ActivationOffload: gradients identical to the plain
run, in one process (fp32, and every accepted combination under bf16-true's forward context), under W=2 ep=2 (FSDP2
over 2 ranks, experts split over ep) and W=2 tp=2 ep=2; routing statistics counted once; bad settings raise
ValueError."""

from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_distributed
from lightning.pytorch.plugins.precision import HalfPrecision

from _memory import assert_same, gqa_config, mla_config, reference_model, step, tokens
from lightning_moe.autograd import in_recomputation
from lightning_moe.callbacks import ActivationOffload
from lightning_moe.callbacks.activation_offload import OFFLOAD_MODULES
from lightning_moe.parallel.layout import RECOMPUTE_KINDS, parse_activation_checkpointing
from lightning_moe.parallel.parallelize import apply_ac

COMPOSED = ["norm", "moe_act", "attn_core"]
VARIANTS = [[k] for k in RECOMPUTE_KINDS] + [["full"], ["full", *COMPOSED], list(RECOMPUTE_KINDS)]


def _run(cfg, kinds, offload=None, ids=None, steps=1, num_layers=None, bf16=False):
    """One step of a copy of the reference model; ``bf16``: the model in bf16, its forward under Lightning's
    ``bf16-true`` forward context (default dtype bf16 there, fp32 in the backward), as on the GPU."""
    model = copy.deepcopy(reference_model(cfg))
    if bf16:
        model.to(torch.bfloat16)
    if offload is not None:
        ActivationOffload(offload, min_bytes=0).transform_model(model)  # a model transform: before parallelize
    apply_ac(model, kinds, num_layers=num_layers)
    ids = tokens(cfg) if ids is None else ids
    return step(model, ids, steps=steps, **({"forward_context": HalfPrecision("bf16-true").forward_context} if bf16
                                           else {}))


@pytest.mark.parametrize("cfg_fn", [gqa_config, mla_config], ids=["gqa", "mla"])
def test_each_recompute_kind_gives_identical_gradients(cfg_fn):
    cfg = cfg_fn()
    base = _run(cfg, "none")
    for kinds in VARIANTS:
        assert_same(_run(cfg, kinds), base)


# Every combination the API accepts: none, full, full@n, each kind, all kinds, full(@n) + kinds; each with no offload,
# each offload kind alone, and all of them.
AC_SETTINGS = [("none", None), ("full", None), ("full", 1), *[([k], None) for k in RECOMPUTE_KINDS],
               (list(RECOMPUTE_KINDS), None), (["full", *COMPOSED], None), (["full", *COMPOSED], 2),
               (["full", *RECOMPUTE_KINDS], 1)]
OFFLOADS = [None, *[[m] for m in OFFLOAD_MODULES], list(OFFLOAD_MODULES)]
_BF16_BASE: dict = {}


@pytest.mark.parametrize("offload", OFFLOADS, ids=lambda o: "+".join(o) if o else "no_offload")
@pytest.mark.parametrize("ac", AC_SETTINGS, ids=lambda a: "+".join([a[0]] if isinstance(a[0], str) else a[0])
                         + (f"@{a[1]}" if a[1] else ""))
@pytest.mark.parametrize("cfg_fn", [gqa_config, mla_config], ids=["gqa", "mla"])
def test_every_accepted_combination_matches_no_option_under_bf16_true(cfg_fn, ac, offload):
    """The GPU's precision on CPU: bf16 weights, the forward under bf16-true's default dtype, the backward (and so
    every recomputation) outside it. Losses, gradients and routing statistics bit-equal to no option."""
    cfg = cfg_fn()
    if cfg_fn not in _BF16_BASE:
        _BF16_BASE[cfg_fn] = _run(cfg, "none", bf16=True)
    kinds, n = ac
    assert_same(_run(cfg, kinds, offload, num_layers=n, bf16=True), _BF16_BASE[cfg_fn])


class _SavesEmpty(torch.autograd.Function):
    """Identity on ``x`` that saves ``empty`` for its backward: what torch 2.11's checkpoint does with its input saver."""

    @staticmethod
    def forward(ctx, empty, x):
        ctx.save_for_backward(empty)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (empty,) = ctx.saved_tensors
        return torch.zeros_like(empty), grad


def test_recomputation_replays_the_forward_default_dtype_and_marks_itself():
    """A tensor the forward creates in the default dtype and saves (as torch 2.11's nested checkpoint does with its
    empty input saver, which made full + norm fail on the GPU under bf16-true) is recreated alike when blocks and
    their nested regions are recomputed in the backward, where Lightning's forward context no longer holds; the
    re-runs, and only they, see in_recomputation()."""
    cfg = gqa_config()
    seen = []

    def with_default_dtype_tensor(model):
        for block in model.layers.values():
            norm = block.attention_norm._forward  # the body behind the norm's seam (its plan still runs around it)

            def forward(x, norm=norm):
                seen.append((torch.get_default_dtype(), in_recomputation()))
                return _SavesEmpty.apply(torch.empty(0, requires_grad=True), norm(x))
            block.attention_norm._forward = forward
        return model

    def run(kinds):
        model = with_default_dtype_tensor(copy.deepcopy(reference_model(cfg)).to(torch.bfloat16))
        apply_ac(model, kinds)
        return step(model, tokens(cfg), forward_context=HalfPrecision("bf16-true").forward_context)

    base = run("none")
    assert seen == [(torch.bfloat16, False)] * cfg.num_layers
    for kinds in (["full"], ["norm"], ["full", "norm"]):
        seen.clear()
        assert_same(run(kinds), base)
        forwards = [s for s in seen if not s[1]]
        assert forwards == [(torch.bfloat16, False)] * cfg.num_layers, kinds
        # re-runs: one per block and region (full + norm: the block's, then the nested norm's own)
        assert len(seen) - len(forwards) == cfg.num_layers * len(kinds), (kinds, seen)
        assert {s[0] for s in seen} == {torch.bfloat16}, (kinds, seen)
    assert not in_recomputation()


def test_recompute_keeps_state_dict_keys_and_plans_seams():
    cfg = mla_config()
    plain, model = reference_model(cfg), reference_model(cfg)
    apply_ac(model, list(RECOMPUTE_KINDS))
    assert list(model.state_dict()) == list(plain.state_dict())
    blk = model.layers["1"]
    planned = {m: m.activation_plan.recompute.seams for m in (
        blk.attention_norm, blk.attention.core_attention, blk.attention, blk.moe.experts, blk.moe.shared_experts,
        blk.moe, blk)}
    assert planned == {blk.attention_norm: {"forward"}, blk.attention.core_attention: {"forward"},
                       blk.attention: {"up_proj"}, blk.moe.experts: {"forward", "act_down"},
                       blk.moe.shared_experts: {"forward"}, blk.moe: set(), blk: set()}
    # methods are never replaced: the plan is read at the seams
    for m in model.modules():
        assert not {"forward", "act_down", "up_proj"} & set(vars(m)), type(m).__name__
    apply_ac(model, "full")  # "full" plans every block, keeping the kinds already planned
    assert all(b.activation_plan.recompute.seams == {"forward"} for b in model.layers.values())
    assert blk.moe.experts.activation_plan.recompute.seams == {"forward", "act_down"}


def test_routing_statistics_and_losses_counted_once_under_recomputation():
    cfg = gqa_config()
    ids = tokens(cfg)
    base = _run(cfg, "none", ids=ids, steps=2)
    for kinds in (["full", *RECOMPUTE_KINDS], ["experts", "moe_act"]):
        got = _run(cfg, kinds, offload=["moe"], ids=ids, steps=2)
        assert_same(got, base)
        for st in got["stats"]:  # dropless: k assignments per token, two forwards
            assert int(st.tokens_per_expert.sum()) == 2 * cfg.moe.top_k * ids.numel()
            assert int(st.num_tokens) == 2 * ids.numel()


@pytest.mark.parametrize("value", ["bogus", ["norm", "attention"], ["none", "norm"], "", 3])
def test_invalid_activation_checkpointing_raises(value):
    with pytest.raises(ValueError, match="activation_checkpointing"):
        parse_activation_checkpointing(value)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        apply_ac(reference_model(gqa_config()), value)


def test_strategy_and_cli_forms_of_the_kinds():
    from lightning_moe import MoEParallelStrategy

    assert parse_activation_checkpointing("[norm, moe_act]") == ("norm", "moe_act")
    assert parse_activation_checkpointing("moe_act,norm") == ("norm", "moe_act")
    assert parse_activation_checkpointing(["experts", "full"]) == ("full", "experts")
    assert parse_activation_checkpointing("none") == () == parse_activation_checkpointing([])
    assert MoEParallelStrategy(activation_checkpointing=["norm", "moe_act"])._activation_checkpointing == (
        "norm", "moe_act")
    with pytest.raises(ValueError, match="valid"):
        MoEParallelStrategy(activation_checkpointing=["norm", "moe_ac"])


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of one forward (each storage once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: dict[int, int] = {}  # storage -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    return sum(sizes.values())


def test_full_on_the_first_n_blocks_dials_memory_and_keeps_gradients():
    """recompute_num_layers=n wraps blocks 0..n-1 only: gradients identical, saved bytes strictly between none and
    full (measured with saved-tensor hooks), state-dict keys unchanged; bad values name the fix."""
    cfg = gqa_config()
    ids = tokens(cfg)
    base = _run(cfg, "none", ids=ids)
    saved = {}
    for n in (None, 1, 2):
        model = copy.deepcopy(reference_model(cfg))
        keys = list(model.state_dict())
        apply_ac(model, ["full", "norm"], num_layers=n)
        wrapped = ["forward" in b.activation_plan.recompute.seams for b in model.layers.values()]
        assert wrapped == [n is None or i < n for i in range(cfg.num_layers)]
        assert list(model.state_dict()) == keys
        assert_same(step(model, ids), base)
        saved[n] = _saved_bytes(model, ids)  # after the step: this forward's routing statistics are not compared
    plain = _saved_bytes(copy.deepcopy(reference_model(cfg)), ids)
    assert saved[None] < saved[2] < saved[1] < plain
    with pytest.raises(ValueError, match="has 3 transformer blocks"):
        apply_ac(reference_model(cfg), "full", num_layers=4)
    with pytest.raises(ValueError, match="add 'full'"):
        apply_ac(reference_model(cfg), ["norm"], num_layers=1)
    from lightning_moe import MoEParallelStrategy

    with pytest.raises(ValueError, match="positive integer"):
        MoEParallelStrategy(activation_checkpointing="full", recompute_num_layers=0)
    with pytest.raises(ValueError, match="add 'full'"):
        MoEParallelStrategy(recompute_num_layers=2)
    assert MoEParallelStrategy(activation_checkpointing="full", recompute_num_layers=2)._recompute_num_layers == 2


# ---- W=2, ep=2 (dp_shard=2: FSDP2 on the dense mesh; experts Shard(0) over ep) --------------------------------
def _ep2_worker(rank: int, world_size: int, tp: int = 1) -> str:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lightning_moe.build import build_model
    from lightning_moe.parallel import ParallelDims, parallelize

    torch.manual_seed(0)
    dims = ParallelDims(world_size=world_size, ep=2, tp=tp).build_meshes("cpu")
    # tp with MLA is not supported (a ValueError): the tp run checks GQA attention with sequence parallel
    for cfg in (gqa_config(), mla_config()) if tp == 1 else (gqa_config(),):
        weights = reference_model(cfg).state_dict()
        ids = tokens(cfg, seed=100 + (rank if tp == 1 else 0))  # each data rank its own tokens; tp peers share them

        def run(kinds, offload=None):
            def load(model):
                set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))
                model.reset_buffers()

            transforms = [ActivationOffload(offload, min_bytes=0).transform_model] if offload else []
            model = build_model(cfg, transforms=transforms, initialize=load,
                                parallelize=lambda m: (parallelize(m, dims, activation_checkpointing=kinds), m)[1])
            return step(model, ids)

        base = run("none")
        for kinds, offload in [*[(k, None) for k in VARIANTS], ("none", ["moe", "attention"]),
                               (COMPOSED, ["moe", "attention"]), (["full"], ["experts"])]:
            try:
                assert_same(run(kinds, offload), base)
            except Exception as e:
                raise AssertionError(f"{cfg.attention} {kinds} offload={offload}: {str(e)[:300]}") from e
    return "ok"


def test_recompute_and_offload_identical_under_ep2():
    assert run_distributed(_ep2_worker, 2) == "ok"


def _tp2_worker(rank: int, world_size: int) -> str:
    return _ep2_worker(rank, world_size, tp=2)


def test_recompute_and_offload_identical_under_tp2_ep2():
    """tp=2 with sequence parallel (attention and norms on tp DTensors), experts over ep=2 folded onto the tp ranks."""
    assert run_distributed(_tp2_worker, 2) == "ok"


def test_plan_accepts_lists_of_kinds(tmp_path, capsys):
    import yaml

    from lightning_moe.cli import plan_main
    from lightning_moe.parallel.dims import ParallelDims
    from lightning_moe.plan import layout_plan

    cfg = gqa_config()
    dims = ParallelDims(world_size=2, ep=2)
    full = layout_plan(cfg, dims, "bf16-true", 16, 1, "full")
    sel = layout_plan(cfg, dims, "bf16-true", 16, 1, ["moe_act", "norm"])
    assert (full.a2a.transfers, sel.a2a.transfers) == (6, 4)  # selective kinds re-run no all-to-all
    assert sel.activation_checkpointing == "norm,moe_act"
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"config": "tiny"}, "data": {"seq_len": 64, "batch_size": 2},
        "trainer": {"devices": 2, "strategy": {"class_path": "lightning_moe.MoEParallelStrategy",
                                               "init_args": {"ep": 2, "activation_checkpointing": ["norm", "moe_act"]}}}}))
    assert plan_main(["--config", str(path)]) == 0
    assert "recomputing norm,moe_act" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_main(["--config", str(path), "--activation-checkpointing", "norm,bogus"])
