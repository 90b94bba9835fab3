"""Sparse upcycling: at initialisation the MoE model computes exactly what the dense model does."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.config import ModelConfig, MoEConfig
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.models.upcycle import upcycle_state_dict

DENSE = ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, dense_hidden_size=64,
                    max_seq_len=32, init_std=0.1, moe=MoEConfig(num_experts=0))


@pytest.mark.parametrize("g, moe", [
    (1, MoEConfig(num_experts=4, top_k=2, expert_hidden_size=64)),
    (2, MoEConfig(num_experts=8, top_k=4, expert_hidden_size=32, first_k_dense=1)),
    (4, MoEConfig(num_experts=8, top_k=4, expert_hidden_size=16, pre_softmax=False)),
    (2, MoEConfig(num_experts=8, top_k=4, expert_hidden_size=32, score_func="sigmoid", expert_bias=True,
                  scaling_factor=2.5, num_groups=2, group_topk=1)),
])
def test_upcycled_model_equals_dense_at_init(g, moe):
    torch.manual_seed(0)
    dense = MoETransformer(DENSE).eval()
    dense.init_weights()
    sd, cfg = upcycle_state_dict(dense.state_dict(), DENSE, moe, granularity=g,
                                 generator=torch.Generator().manual_seed(1))
    model = MoETransformer(cfg).eval()
    model.load_state_dict(sd, strict=True)
    assert len(model.moe_layers()) == 3 - moe.first_k_dense
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), dense(ids), rtol=1e-5, atol=1e-5)
        # the router is fresh: tokens spread over the replicas
        ids_TK = model.moe_layers()[0].router(model.tok_embeddings(ids)).expert_ids
    assert ids_TK.unique().numel() > moe.top_k


@pytest.mark.parametrize("g, moe, match", [
    (1, MoEConfig(num_experts=4, top_k=2, expert_hidden_size=64, norm_topk_prob=False), "norm_topk_prob"),
    (2, MoEConfig(num_experts=8, top_k=3, expert_hidden_size=32), "multiples of granularity"),
    (2, MoEConfig(num_experts=8, top_k=2, expert_hidden_size=64), "expert_hidden_size"),
    (2, MoEConfig(num_experts=8, top_k=2, expert_hidden_size=32, shared_expert_hidden_size=8), "shared"),
])
def test_upcycling_refuses_what_would_change_the_output(g, moe, match):
    dense = MoETransformer(DENSE)
    with pytest.raises(ValueError, match=match):
        upcycle_state_dict(dense.state_dict(), DENSE, moe, granularity=g)
