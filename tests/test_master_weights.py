"""bf16 compute with fp32 master state: MasterAdamW (lightning_moe.optim.master) against torch's AdamW, its Triton kernel
against the reference (interpreter on CPU), its state dict, the strategy's FSDP2 dtype checks, exact resumes under
bf16-true (one process and W=2 ep=2, and across the two), and exports that write the masters.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import lightning as L
import pytest
import torch

from lightning_moe.optim import MasterAdamW
from lightning_moe.optim.master import _reference_update

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
HYPER = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8)


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 matrices and vectors, an fp32 one (a router), odd sizes."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"w1": (33, 17), "w2": (64, 8), "bias": (5,), "norm": (17,)}
    out = {k: torch.randn(s, generator=g).bfloat16() for k, s in shapes.items()}
    out["router"] = torch.randn(4, 17, generator=g)
    return out


def _grads(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s gradients, in the dtypes of :func:`_params` (bf16, the router fp32)."""
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in _params().items()}


def _groups(params: dict[str, torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": [params["w1"], params["w2"], params["router"]], "weight_decay": 0.1},
            {"params": [params["bias"], params["norm"]], "weight_decay": 0.0}]


def _train(opt_cls: Any, params: dict[str, torch.nn.Parameter], steps: range, cast_grads: bool = False,
           skip: tuple[str, int] = ("", -1), **kw: Any) -> torch.optim.Optimizer:
    opt = opt_cls(_groups(params), **HYPER, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for step in steps:
        for k, grad in _grads(step).items():
            params[k].grad = None if (k, step) == skip else (grad.float() if cast_grads else grad)
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt


def test_reference_step_is_torch_adamw_on_fp32_copies():
    """The fp32 masters follow torch.optim.AdamW run on fp32 copies of the bf16 weights with the bf16 gradients, bit
    for bit (weight-decay groups, an LR schedule, a step a parameter sits out); the parameters are the masters rounded
    to nearest even; the fp32 router is its own master."""
    start = _params()
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    ref = {k: torch.nn.Parameter(v.float()) for k, v in start.items()}
    opt = _train(MasterAdamW, ours, range(6), skip=("w2", 2), fused=False)
    ref_opt = _train(torch.optim.AdamW, ref, range(6), cast_grads=True, skip=("w2", 2), foreach=False)
    for k, p in ours.items():
        state, want = opt.state[p], ref_opt.state[ref[k]]
        weight = state.get("master", p)
        assert weight.dtype == torch.float32 and ("master" in state) == (k != "router"), k
        assert torch.equal(weight, ref[k].detach()), k
        assert torch.equal(state["exp_avg"], want["exp_avg"]) and torch.equal(state["exp_avg_sq"], want["exp_avg_sq"])
        assert state["exp_avg"].dtype == torch.float32 and float(state["step"]) == float(want["step"])
        assert torch.equal(p.detach(), weight.to(p.dtype)), k
    assert float(opt.state[ours["w2"]]["step"]) == 5  # the step it had no gradient was skipped
    assert not torch.equal(ours["w1"].detach().float(), start["w1"].float())


def test_small_updates_survive_in_the_master():
    """Updates far below bf16's resolution (lr 1e-4 on weights of 1.0: a step is 1/40 of the spacing 2^-7 there)
    vanish under bf16 AdamW; the master adds them up until the bf16 weight moves."""
    def run(opt_cls: Any, **kw: Any) -> torch.Tensor:
        p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        opt = opt_cls([p], lr=1e-4, weight_decay=0.0, **kw)
        for _ in range(200):
            p.grad = torch.ones_like(p)
            opt.step()
        return p.detach().float()

    assert torch.equal(run(torch.optim.AdamW, foreach=False), torch.ones(64))
    moved = run(MasterAdamW, fused=False)
    assert torch.all(moved < 1.0) and torch.allclose(moved, torch.full((64,), 1 - 200e-4), atol=2**-8)


@needs_triton
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's two lerp formulas
def test_triton_kernel_equals_the_reference(beta1):
    """The fused kernel (Triton's interpreter on CPU) against the torch reference: sizes around and across its block,
    an empty tensor, bf16 / fp16 parameters with masters and fp32 ones without; fp32 rounding apart, the bf16 and
    fp16 parameters exactly the masters rounded to nearest even."""
    from lightning_moe.optim import _triton_adamw
    from lightning_moe.optim.master import _fused_update

    B = _triton_adamw.BLOCK
    gen = torch.Generator().manual_seed(0)
    hyper = dict(lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3.0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        sizes = [1, 7, B - 1, B, B + 1, 3 * B + 5, 0]
        kernel, reference, before = [], [], []
        for n in sizes:
            w = torch.randn(n, generator=gen) * 3
            grad = torch.randn(n, generator=gen).to(dtype)
            m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
            before.append(w)
            for entries in (kernel, reference):
                p = w.to(dtype, copy=True)  # fp32: the parameter is its own master
                weight = w.clone() if dtype != torch.float32 else p
                entries.append((grad, weight, m.clone(), v.clone(), p if dtype != torch.float32 else None))
        _fused_update(kernel, **hyper)
        _reference_update(reference, **hyper)
        for n, w0, got, want in zip(sizes, before, kernel, reference):
            for i, what in ((1, "weight"), (2, "exp_avg"), (3, "exp_avg_sq")):
                torch.testing.assert_close(got[i], want[i], rtol=1e-6, atol=1e-8, msg=f"{dtype} n={n} {what}")
            if n:
                assert not torch.equal(got[1], w0), f"{dtype} n={n}: the weight did not move"
            if got[4] is not None:
                assert torch.equal(got[4], got[1].to(dtype)), f"{dtype} n={n}: parameter is not the rounded master"
    # tensors that are not 16-byte aligned (views one element in): the launch without alignment hints
    n = B + 3
    base = [torch.randn(n + 1, generator=gen) for _ in range(3)] + [torch.rand(n + 1, generator=gen)]
    runs = []
    for _ in range(2):
        g, w, m, v = (t.clone()[1:] for t in base)
        runs.append([(g.bfloat16(), w, m, v.abs() * 0.01, torch.empty(n + 1, dtype=torch.bfloat16)[1:])])
    assert runs[0][0][1].data_ptr() % 16 != 0
    _fused_update(runs[0], **hyper)
    _reference_update(runs[1], **hyper)
    for i in (1, 2, 3):  # one or two fp32 ulps of weights near 1 (the update's rounding order differs)
        torch.testing.assert_close(runs[0][0][i], runs[1][0][i], rtol=1e-6, atol=2.5e-7)
    assert torch.equal(runs[0][0][4], runs[0][0][1].bfloat16())


@needs_triton
def test_fused_optimizer_step_matches_reference_optimizer():
    """MasterAdamW(fused=True) (interpreter) and fused=False train the same: the launches per dtype group and
    parameter group, weight decay per group, the LR schedule."""
    start = _params()
    runs = {}
    for fused in (True, False):
        params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
        opt = _train(MasterAdamW, params, range(4), fused=fused)
        assert opt.fused is fused
        runs[fused] = (params, opt)
    for k in start:
        (pf, of), (pr, orf) = (runs[True][0][k], runs[True][1]), (runs[False][0][k], runs[False][1])
        torch.testing.assert_close(of.state[pf].get("master", pf), orf.state[pr].get("master", pr), rtol=1e-6,
                                   atol=1e-7)
        torch.testing.assert_close(of.state[pf]["exp_avg_sq"], orf.state[pr]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


def test_fused_default_is_the_reference_on_cpu():
    assert MasterAdamW([torch.nn.Parameter(torch.ones(2))]).fused is False


def test_state_dict_round_trip_keeps_fp32_state_and_continues_exactly():
    """The masters and moments come back fp32 (Optimizer.load_state_dict alone would round them to the bf16
    parameters' dtype), on the host step counts; the continued run equals the uninterrupted one bit for bit."""
    start = _params()
    whole = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    _train(MasterAdamW, whole, range(5), fused=False)

    first = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    opt = _train(MasterAdamW, first, range(3), fused=False)
    saved = opt.state_dict()
    masters = {k: opt.state[p]["master"].clone() for k, p in first.items() if k != "router"}
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())  # not bf16-representable

    second = {k: torch.nn.Parameter(p.detach().clone()) for k, p in first.items()}
    resumed = MasterAdamW(_groups(second), **HYPER, fused=False)
    resumed.load_state_dict(saved)
    for k, p in second.items():
        state = resumed.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["step"].device.type == "cpu", k
        if k != "router":
            assert torch.equal(state["master"], masters[k]), k
    assert saved["state"][0]["master"].dtype == torch.float32  # the caller's dict was not rewritten
    # the schedule at the uninterrupted run's position (the loaded groups hold initial_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(resumed, lambda s: 1.0 / (1 + s), last_epoch=2)
    assert resumed.param_groups[0]["lr"] == HYPER["lr"] / 4
    for step in range(3, 5):
        for k, grad in _grads(step).items():
            second[k].grad = grad
        resumed.step()
        sched.step()
    for k in start:
        assert torch.equal(second[k], whole[k]), k


def test_loading_a_bf16_adamw_state_makes_masters():
    """A checkpoint of torch's AdamW on bf16 parameters (bf16 moments, no master) resumes with fp32 moments of the
    same values and masters made from the parameters."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in _params().items()}
    old = _train(torch.optim.AdamW, params, range(2), foreach=False)
    opt = MasterAdamW(_groups(params), **HYPER, fused=False)
    opt.load_state_dict(old.state_dict())
    w1 = params["w1"]
    assert torch.equal(opt.state[w1]["master"], w1.detach().float())
    assert torch.equal(opt.state[w1]["exp_avg"], old.state[w1]["exp_avg"].float())
    assert opt.state[w1]["exp_avg"].dtype == torch.float32 and "master" not in opt.state[params["router"]]
    w1.grad = torch.ones_like(w1)
    opt.step()  # and it steps from there


def test_master_dtype_option_is_checked():
    from lightning_moe import MoELanguageModel

    with pytest.raises(ValueError, match="master_dtype must be one of"):
        MoELanguageModel("tiny", master_dtype="bf16")
    assert MoELanguageModel("tiny", master_dtype="fp32").master_dtype is torch.float32
    assert MoELanguageModel("tiny").master_dtype is None


@pytest.mark.parametrize("sizes,refused", [
    (dict(world_size=1), "the dense parameters .* nor the routed experts"),
    (dict(world_size=2, ep=2), "not shard the routed experts"),
    (dict(world_size=2, dp_shard=1, tp=2), "not shard the dense parameters"),
    (dict(world_size=2), None),
    (dict(world_size=4, ep=2), None),
])
def test_fsdp_dtypes_are_refused_where_fsdp_does_not_shard(sizes, refused):
    from lightning_moe.parallel.dims import ParallelDims
    from lightning_moe.parallel.parallelize import check_fsdp_dtypes

    dims = ParallelDims(**sizes)
    check_fsdp_dtypes(dims, param_dtype=None, reduce_dtype=None)  # nothing asked, nothing refused
    for kw in (dict(param_dtype=torch.bfloat16, reduce_dtype=None), dict(param_dtype=None, reduce_dtype=torch.float32)):
        if refused is None:
            check_fsdp_dtypes(dims, **kw)
        else:
            with pytest.raises(ValueError, match=refused) as err:
                check_fsdp_dtypes(dims, **kw)
            assert "master_dtype='fp32'" in str(err.value)


def test_one_device_strategy_refuses_param_dtype_at_trainer_construction():
    from lightning_moe import MoEParallelStrategy

    with pytest.raises(ValueError, match="master_dtype='fp32'"):
        L.Trainer(accelerator="cpu", devices=1, strategy=MoEParallelStrategy(param_dtype="bf16"), logger=False)


# ---------------------------------------------------------------------------- Trainer runs (tests/test_resume.py's)
def _check_masters(run: dict[str, Any]) -> None:
    """Every bf16 parameter has an fp32 master whose rounding it is; the routers (fp32) have none."""
    masters, state = run["masters"], run["state"]
    names = {k[len("model."):]: v for k, v in masters.items()}
    assert names and not any("router" in k for k in names)
    for k, m in names.items():
        assert m.dtype == torch.float32
        assert torch.equal(m.bfloat16().float(), state[k]), k


def _exact(resumed: dict[str, Any], ref: dict[str, Any], cut: int) -> list[str]:
    problems = [f"step {cut + 1 + i}: {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(resumed["losses"], ref["losses"][cut:]))
                if a != b]
    problems += [k for k in ref["state"] if not torch.equal(resumed["state"][k], ref["state"][k])]
    problems += [f"master {k}" for k in ref["masters"] if not torch.equal(resumed["masters"][k], ref["masters"][k])]
    return problems


BF16_MASTER = dict(precision="bf16-true", master_dtype="fp32")


@pytest.fixture(scope="module")
def one_process_master(tmp_path_factory) -> dict[str, Any]:
    from test_resume import CUT, STEPS, _fit

    ckpt = str(tmp_path_factory.mktemp("master1") / "step3.ckpt")
    return {"ckpt": ckpt, "ref": _fit("auto", STEPS, **BF16_MASTER), "first": _fit("auto", CUT, ckpt_out=ckpt, **BF16_MASTER),
            "resumed": _fit("auto", STEPS, ckpt_in=ckpt, seed=1, **BF16_MASTER),
            "bf16_adamw": _fit("auto", STEPS, precision="bf16-true")}


def test_one_process_resume_with_master_weights_is_exact(one_process_master):
    from test_resume import CUT

    out = one_process_master
    for run in ("ref", "first", "resumed"):
        _check_masters(out[run])
    assert not _exact(out["resumed"], out["ref"], CUT), _exact(out["resumed"], out["ref"], CUT)
    saved = torch.load(out["ckpt"], weights_only=True)
    state = saved["optimizer_states"][0]["state"]
    assert {k: v["master"] for k, v in state.items() if "master" in v}.keys() == out["first"]["masters"].keys()
    assert all(v["master"].dtype == torch.float32 and v["exp_avg"].dtype == torch.float32
               for v in state.values() if "master" in v)
    # the masters change the run: bf16 AdamW from the same init and batches ends elsewhere
    assert out["bf16_adamw"]["losses"][:1] == out["ref"]["losses"][:1]
    assert out["bf16_adamw"]["losses"][-1] != out["ref"]["losses"][-1]


def _two_ranks_master(rank: int, world_size: int, tmp: str, one_process_ckpt: str) -> dict[str, Any]:
    from test_resume import CUT, STEPS, _fit

    from lightning_moe import MoEParallelStrategy

    out = {"ref": _fit(MoEParallelStrategy(ep=2), STEPS, **BF16_MASTER)}
    out["first"] = _fit(MoEParallelStrategy(ep=2), CUT, ckpt_out=f"{tmp}/ep2_step3", **BF16_MASTER)
    out["resumed"] = _fit(MoEParallelStrategy(ep=2), STEPS, ckpt_in=f"{tmp}/ep2_step3", seed=1, **BF16_MASTER)
    # the one-process checkpoint loaded at W=2 (no step taken: max_steps is where it stopped)
    out["loaded_from_one"] = _fit(MoEParallelStrategy(ep=2), CUT, ckpt_in=one_process_ckpt, seed=1, **BF16_MASTER)
    # tensor parallel (dense parameters split over tp without FSDP2; experts FSDP2-sharded over the same two ranks)
    out["tp2"] = _fit(MoEParallelStrategy(tp=2, dp_shard=1), CUT, **BF16_MASTER)
    return out


def _one_rank_master(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    from test_resume import CUT, _fit

    from lightning_moe import MoEParallelStrategy

    return _fit(MoEParallelStrategy(), CUT, ckpt_in=ckpt, seed=1, **BF16_MASTER)


@pytest.mark.timeout(400)
def test_ep2_resume_and_layout_changes_with_master_weights(one_process_master, tmp_path):
    """W=2 ep=2 (dense parameters FSDP2-sharded with fp32 gradient reduction, experts split by ep): the masters are
    DTensors where the parameters are; the resume is exact; the masters reshard exactly 1 -> W2 and W2 -> 1."""
    from _dist import run_distributed
    from test_resume import CUT

    out = run_distributed(_two_ranks_master, 2, str(tmp_path), one_process_master["ckpt"], timeout=380)
    for run in ("ref", "first", "resumed", "loaded_from_one", "tp2"):
        _check_masters(out[run])
        layouts = out[run]["master_layouts"]
        assert all(param == master and same for param, master, same in layouts.values()), layouts
        kinds = {param for param, _, _ in layouts.values()}
        if run == "tp2":  # column / row splits over tp, FSDP2 over the experts' edp_shard
            assert {"('tp',) (Shard(dim=0),)", "('tp',) (Shard(dim=1),)"} <= kinds, kinds
            assert any("edp_shard" in k for k in kinds), kinds
        else:  # FSDP2's shards of the dense parameters, ep's of the experts
            assert {"('dp_shard_cp',) (Shard(dim=0),)", "('ep',) (Shard(dim=0),)"} <= kinds, kinds
    assert all(math.isfinite(v) for v in out["tp2"]["losses"]) and len(out["tp2"]["losses"]) == CUT
    assert not _exact(out["resumed"], out["ref"], CUT), _exact(out["resumed"], out["ref"], CUT)
    one = one_process_master["first"]
    loaded = out["loaded_from_one"]
    assert loaded["masters"].keys() == one["masters"].keys()
    assert all(torch.equal(loaded["masters"][k], v) for k, v in one["masters"].items())
    back = run_distributed(_one_rank_master, 1, f"{tmp_path}/ep2_step3")
    assert all(torch.equal(back["masters"][k], v) for k, v in out["first"]["masters"].items())
    assert all(torch.equal(back["state"][k], v) for k, v in out["first"]["state"].items())
    # the distributed checkpoint loads for generation / export as its full fp32 masters
    from lightning_moe.generation import load_for_generation

    model, _ = load_for_generation(f"{tmp_path}/ep2_step3")
    got = dict(model.named_parameters())
    assert all(torch.equal(got[k[len("model."):]], v) for k, v in out["first"]["masters"].items())


def test_load_for_generation_reads_the_masters(one_process_master):
    """A checkpoint file with masters loads as the fp32 masters (dtype None) or their bf16 rounding (the parameters)."""
    from lightning_moe.generation import load_for_generation

    first = one_process_master["first"]
    model, _ = load_for_generation(one_process_master["ckpt"])
    got = dict(model.named_parameters())
    for k, m in first["masters"].items():
        assert got[k[len("model."):]].dtype == torch.float32 and torch.equal(got[k[len("model."):]], m), k
    model, _ = load_for_generation(one_process_master["ckpt"], dtype=torch.bfloat16)
    for k, v in model.state_dict().items():
        if "router" not in k and v.is_floating_point() and "expert_bias" not in k:
            assert v.dtype == torch.bfloat16 and torch.equal(v.float(), first["state"][k]), k


def test_save_pretrained_and_export_write_the_masters(tmp_path):
    """save_pretrained after training with masters writes them (fp32) unless a dtype is asked for; `lightning-moe
    export` of the checkpoint does the same."""
    from parallel_harness import GLOBAL_BATCH, FixedData, small_config
    from safetensors.torch import load_file

    from lightning_moe import MoELanguageModel
    from lightning_moe.export import export_main

    cfg = small_config(score_func="softmax", expert_bias=False, shared_expert_hidden_size=0, aux_loss_type="aux")
    module = MoELanguageModel(cfg, warmup_steps=0, lr=1e-2, master_dtype="fp32")
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=FixedData(GLOBAL_BATCH, 2 * GLOBAL_BATCH))
    emb = module.model.tok_embeddings.weight
    master = trainer.optimizers[0].state[emb]["master"]
    assert not torch.equal(master, emb.float())  # the master holds more than its bf16 rounding
    ckpt = str(tmp_path / "m.ckpt")
    trainer.save_checkpoint(ckpt)

    def embedding(folder: Any) -> torch.Tensor:
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        return tensors["model.embed_tokens.weight"]

    module.save_pretrained(str(tmp_path / "fp32"))
    assert torch.equal(embedding(tmp_path / "fp32"), master)
    module.save_pretrained(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    assert torch.equal(embedding(tmp_path / "bf16"), emb.detach())
    assert export_main([ckpt, str(tmp_path / "exported")]) == 0
    assert torch.equal(embedding(tmp_path / "exported"), master)
    assert export_main([ckpt, str(tmp_path / "exported16"), "--dtype", "bf16"]) == 0
    assert torch.equal(embedding(tmp_path / "exported16"), emb.detach())


def _reduce_in_fp32(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_moe.parallel.grads import all_reduce_grads

    seen: list[torch.dtype] = []
    real = dist.all_reduce

    def recording(t: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.append(t.dtype)
        return real(t, *a, **kw)

    dist.all_reduce = recording
    try:
        ps = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (5, 3)]
        for i, p in enumerate(ps):
            p.grad = torch.full_like(p, 1 + i + rank / 4)
        all_reduce_grads(ps, None, reduce_dtype=torch.float32)
        lone = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
        lone.grad = torch.full_like(lone, 0.5)
        all_reduce_grads([lone], None, reduce_dtype=torch.float32)
    finally:
        dist.all_reduce = real
    return {"seen": seen, "grads": [p.grad.clone() for p in ps], "lone": lone.grad.clone()}


def test_tp_gradient_sums_run_in_the_dtype_asked_for():
    """all_reduce_grads(reduce_dtype=fp32) (the tp sums of the finalisation under fp32 masters) reduces bf16
    gradients in fp32 buckets and writes the sums back into the bf16 gradients."""
    from _dist import run_distributed

    out = run_distributed(_reduce_in_fp32, 2)
    assert out["seen"] == [torch.float32, torch.float32]
    assert [g.dtype for g in out["grads"]] == [torch.bfloat16] * 2
    assert torch.equal(out["grads"][0], torch.full((5,), 2.25, dtype=torch.bfloat16))
    assert torch.equal(out["grads"][1], torch.full((3,), 4.25, dtype=torch.bfloat16))
    assert torch.equal(out["lone"], torch.ones(4, dtype=torch.bfloat16))
