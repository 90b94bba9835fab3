"""Capacity mode under expert parallelism: each rank applies the capacity rule to its own tokens, exactly as a
reference that routes that rank's tokens alone, and the dropped fraction is reported."""

from __future__ import annotations

import copy
import dataclasses
import math

import lightning as L
import torch

from _dist import run_distributed
from lightning_moe.config import MoEConfig
from lightning_moe.moe.dispatch import AllToAllDispatcher
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.record import MoERecorder
from lightning_moe.parallel.parallelize import _shard_param

D, S, E, K = 32, 24, 4, 2


def _config(policy: str) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, expert_hidden_size=16, capacity_factor=0.5, drop_policy=policy,
                     aux_loss_type="none")


def _expected_keep_position(ids_TK: torch.Tensor, capacity: int) -> torch.Tensor:
    """The rule written out: walk tokens in order, each token's choices in order; an expert keeps its first
    ``capacity`` assignments."""
    keep = torch.zeros_like(ids_TK, dtype=torch.bool)
    used = [0] * E
    for t in range(ids_TK.shape[0]):
        for j in range(ids_TK.shape[1]):
            e = int(ids_TK[t, j])
            if used[e] < capacity:
                keep[t, j] = True
                used[e] += 1
    return keep


def _expected_keep_probs(ids_TK: torch.Tensor, probs_TK: torch.Tensor, capacity: int) -> torch.Tensor:
    """Per expert, the ``capacity`` highest combine weights; ties to the earlier token."""
    keep = torch.zeros_like(ids_TK, dtype=torch.bool)
    for e in range(E):
        cand = [(-float(probs_TK[t, j]), t, j) for t in range(ids_TK.shape[0]) for j in range(ids_TK.shape[1])
                if int(ids_TK[t, j]) == e]
        for _, t, j in sorted(cand)[:capacity]:
            keep[t, j] = True
    return keep


def _worker(rank: int, world_size: int, policy: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)  # identical weights on both ranks
    ref = MoELayer(_config(policy), D)
    ep_layer = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    for name in ("w1", "w3", "w2"):
        from torch.distributed.tensor import Shard

        _shard_param(ep_layer.experts, name, mesh, [Shard(0)])
    ep_layer.replan(dispatcher=AllToAllDispatcher(mesh.get_group()))

    torch.manual_seed(100 + rank)  # every rank has its own tokens
    x = torch.randn(1, S, D)
    y_ref = ref(x)
    recorder = MoERecorder()
    y_ep = ep_layer(x, recorder=recorder)
    torch.testing.assert_close(y_ep, y_ref, rtol=1e-5, atol=1e-6)

    routing = ref.router(x.reshape(S, D), seq_len=S)
    capacity = math.ceil(0.5 * S * K / E)
    assert routing.capacity == capacity
    if policy == "position":
        expected = _expected_keep_position(routing.expert_ids, capacity)
    else:
        # the kept set among the router's chosen (unnormalised-by-capacity) probs: recompute without dropping
        dropless = copy.deepcopy(ref.router)
        dropless.config = dataclasses.replace(dropless.config, capacity_factor=None)
        probs = dropless(x.reshape(S, D), seq_len=S).probs
        expected = _expected_keep_probs(routing.expert_ids, probs, capacity)
    assert routing.keep_mask is not None
    assert torch.equal(routing.keep_mask, expected), (routing.keep_mask, expected)
    n_dropped = int((~expected).sum())
    assert n_dropped > 0, "the case should drop something"
    st = recorder.records[0].routing
    assert int(st.num_dropped) == n_dropped
    assert int(st.tokens_per_expert.sum()) == S * K - n_dropped
    return {"dropped": n_dropped}


def test_capacity_under_ep_matches_local_rule_position():
    run_distributed(_worker, 2, "position")


def test_capacity_under_ep_matches_local_rule_probs():
    run_distributed(_worker, 2, "probs")


class _Tokens(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": torch.randint(0, 260, (16,), generator=g)} for _ in range(8)]
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_dropped_fraction_is_logged(tmp_path):
    from lightning_moe import LoadBalanceMonitor, MoELanguageModel, ModelConfig

    cfg = ModelConfig.from_preset(
        "tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, dense_hidden_size=32,
        moe=dict(num_experts=4, top_k=2, expert_hidden_size=16, capacity_factor=0.5, first_k_dense=1,
                 shared_expert_hidden_size=0),
    )
    model = MoELanguageModel(cfg, warmup_steps=0)
    monitor = LoadBalanceMonitor(log_every_n_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[monitor])
    trainer.fit(model, datamodule=_Tokens())
    frac = monitor.last_metrics["moe/layer1/dropped_fraction"]
    stats = model.step_result.routing[1]  # the step's record, which the monitor read
    expected = float(stats.num_dropped) / (4 * 16 * 2)
    assert frac > 0
    assert abs(frac - expected) < 1e-6
