"""Optimizer state is saved and restored by parameter name, so it maps onto the right parameters whatever the
parameter grouping (which depends on the layout: fused AdamW keeps DTensor and plain parameters apart)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from _dist import run_distributed
from parallel_harness import GLOBAL_BATCH, FixedData, small_config

from lightning_moe import MoELanguageModel, MoEParallelStrategy
from lightning_moe.checkpoint.optimizer_state import is_by_name, optimizer_state_by_index, optimizer_state_by_name


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def test_by_name_round_trip_across_groupings():
    a = _model()
    params = dict(a.named_parameters())
    opt_a = torch.optim.AdamW([{"params": [params["0.weight"], params["2.weight"]], "weight_decay": 0.1},
                               {"params": [params["0.bias"], params["1.weight"], params["1.bias"], params["2.bias"]],
                                "weight_decay": 0.0}], lr=1e-2)
    a(torch.randn(3, 4)).sum().backward()
    opt_a.step()
    saved = optimizer_state_by_name(opt_a.state_dict(), opt_a, a)
    assert is_by_name(saved) and set(saved["state"]) == set(params)

    # another grouping of the same parameters, in another order (as under another layout)
    b = _model()
    pb = dict(b.named_parameters())
    opt_b = torch.optim.AdamW([{"params": [pb["2.weight"]], "weight_decay": 0.1},
                               {"params": [pb["1.bias"], pb["2.bias"]], "weight_decay": 0.0},
                               {"params": [pb["0.weight"]], "weight_decay": 0.1},
                               {"params": [pb["1.weight"], pb["0.bias"]], "weight_decay": 0.0}], lr=1e-3)
    opt_b.load_state_dict(optimizer_state_by_index(saved, opt_b, b))
    for name, p in pb.items():
        want = opt_a.state[params[name]]
        got = opt_b.state[p]
        assert torch.equal(got["exp_avg"], want["exp_avg"]), name
        assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"]), name
    # hyper-parameters follow the parameters, not the group position
    assert [g["weight_decay"] for g in opt_b.param_groups] == [0.1, 0.0, 0.1, 0.0]
    assert all(g["lr"] == 1e-2 for g in opt_b.param_groups)

    # a state for another model is refused with the names
    c = torch.nn.Sequential(torch.nn.Linear(4, 8))
    opt_c = torch.optim.AdamW(c.parameters())
    with pytest.raises(ValueError, match="names parameters this model does not have"):
        optimizer_state_by_index(saved, opt_c, c)


class StateAtStart(Callback):
    """The optimizer state (full tensors, by name) right after a resume, before the first step."""

    def __init__(self) -> None:
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opt = trainer.optimizers[0]
        if isinstance(trainer.strategy, MoEParallelStrategy):
            osd = get_optimizer_state_dict(pl_module, opt, options=StateDictOptions(full_state_dict=True))
        else:
            osd = optimizer_state_by_name(opt.state_dict(), opt, pl_module)
        self.state = {n: {k: v.detach().clone() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
                      for n, s in osd["state"].items()}
        self.groups = len(opt.param_groups)
        # groups that hold DTensors and plain tensors together (lightning_moe.optim.AdamW steps them apart)
        self.mixed = any(len({hasattr(p, "placements") for p in g["params"]}) > 1 for g in opt.param_groups)


def _trainer(strategy: Any, devices: int, steps: int, callbacks: Any = (), root: str = ".") -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                     callbacks=list(callbacks), default_root_dir=root)


def _resume(rank: int, world_size: int, ckpt: str, tmp: str) -> dict:
    out = {}
    for name, layout in (("tp=2 (DTensor and plain groups)", dict(tp=2, dp_shard=1)), ("ep=2", dict(ep=2))):
        torch.manual_seed(1)  # another init: the resume must overwrite it
        model = MoELanguageModel(small_config(), warmup_steps=0)
        cb = StateAtStart()
        dims_dp = 1 if "tp" in layout else 2
        trainer = _trainer(MoEParallelStrategy(**layout), 2, 3, [cb])
        trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH // dims_dp, GLOBAL_BATCH * 3), ckpt_path=ckpt)
        out[name] = {"state": cb.state, "groups": cb.groups, "mixed": cb.mixed, "steps": model.global_step}
    # a distributed checkpoint of one layout resumed under another
    model = MoELanguageModel(small_config(), warmup_steps=0)
    trainer = _trainer(MoEParallelStrategy(ep=2), 2, 3)
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH // 2, GLOBAL_BATCH * 3), ckpt_path=ckpt)
    trainer.save_checkpoint(f"{tmp}/ep2")
    ref = StateAtStart()
    ref.on_train_start(trainer, model)
    torch.manual_seed(2)
    model = MoELanguageModel(small_config(), warmup_steps=0)
    cb = StateAtStart()
    trainer = _trainer(MoEParallelStrategy(tp=2, dp_shard=1), 2, 4, [cb])
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH * 4), ckpt_path=f"{tmp}/ep2")
    out["ep=2 dir -> tp=2"] = {"state": cb.state, "groups": cb.groups, "want": ref.state}
    return out


@pytest.mark.timeout(600)
def test_resume_maps_optimizer_state_by_name_under_other_layouts(tmp_path):
    torch.manual_seed(0)
    model = MoELanguageModel(small_config(), warmup_steps=0)
    trainer = _trainer("auto", 1, 2, root=str(tmp_path))
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH * 2))
    ckpt = str(tmp_path / "one.ckpt")
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["optimizer_states"][0]
    assert is_by_name(saved), "a one-process checkpoint holds the optimizer state by parameter name"
    want = {n: {k: v for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0} for n, s in saved["state"].items()}
    assert len(want) > 10 and all("exp_avg" in s for s in want.values())

    # the same process, Lightning's single-device loader (through the optimizer's by-name load hook)
    torch.manual_seed(5)
    model2 = MoELanguageModel(small_config(), warmup_steps=0)
    cb = StateAtStart()
    _trainer("auto", 1, 3, [cb]).fit(model2, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH * 3), ckpt_path=ckpt)
    results = {"one device": {"state": cb.state, "groups": cb.groups}}
    results.update(run_distributed(_resume, 2, ckpt, str(tmp_path)))
    failures = []
    for name, res in results.items():
        ref = res.get("want", want)
        if set(res["state"]) != set(ref):
            failures.append(f"[{name}] names differ: {sorted(set(res['state']) ^ set(ref))[:5]}")
            continue
        for n, s in ref.items():
            for k, v in s.items():
                if not torch.allclose(res["state"][n][k].float(), v.float(), rtol=0, atol=0):
                    failures.append(f"[{name}] {n}.{k} differs")
    # the same two groups under every layout; under tp without FSDP they mix DTensor and plain parameters, and the
    # resumed run still steps (lightning_moe.optim.AdamW keeps the kinds apart inside the step)
    assert all(res["groups"] == 2 for res in results.values())
    tp = results["tp=2 (DTensor and plain groups)"]
    assert tp["mixed"] and tp["steps"] == 3
    assert not failures, "\n".join(failures[:20])


def _mixed_adamw(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from lightning_moe.optim import AdamW

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    plain = torch.nn.Parameter(torch.randn(4, 3))
    dt = torch.nn.Parameter(distribute_tensor(torch.randn(5, 3), mesh, [Replicate()]))
    ref_plain, ref_dt = torch.nn.Parameter(plain.detach().clone()), torch.nn.Parameter(dt.detach().full_tensor())
    for p, rp in ((plain, ref_plain), (dt, ref_dt)):
        g = torch.randn(p.shape)
        p.grad = distribute_tensor(g, mesh, [Replicate()]) if hasattr(p, "placements") else g
        rp.grad = g.clone()
    out = {}
    try:
        torch.optim.AdamW([plain, dt], lr=0.1, foreach=True).step()
        out["torch"] = "ran"
    except Exception as e:  # torch's multi-tensor kernels cannot take both kinds in one list
        out["torch"] = type(e).__name__
        plain.data.copy_(ref_plain.detach())
    opt = AdamW([{"params": [plain, dt], "weight_decay": 0.1}], lr=0.1, foreach=True)
    opt.step()
    ref = torch.optim.AdamW([{"params": [ref_plain, ref_dt], "weight_decay": 0.1}], lr=0.1, foreach=True)
    ref.step()
    out["equal"] = torch.allclose(plain, ref_plain) and torch.allclose(dt.full_tensor(), ref_dt)
    out["groups"] = len(opt.param_groups)
    return out


def test_adamw_steps_dtensor_and_plain_parameters_of_one_group():
    out = run_distributed(_mixed_adamw, 1)
    assert out["torch"] != "ran", "torch's foreach AdamW mixing DTensor and plain tensors: this test checks nothing"
    assert out["equal"] and out["groups"] == 1
