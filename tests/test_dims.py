"""ParallelDims: pure validation and rank arithmetic, then the real meshes on gloo ranks."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from lightning_moe.config import ModelConfig
from lightning_moe.parallel.dims import ParallelDims


def P(W: int, **sizes) -> ParallelDims:
    return ParallelDims(world_size=W, **sizes)


def raises(match: str):
    return pytest.raises(ValueError, match=re.escape(match))


# ---- sizes -----------------------------------------------------------------------------------------
def test_auto_resolution():
    assert P(8, tp=2).dp_shard == 4
    assert P(8, tp=2, dp_shard="auto").dp_shard == 4
    assert P(8, dp_replicate=2, cp=2).dp_shard == 2
    assert P(1).dp_shard == 1
    d = P(8, tp=2, ep=8)
    assert (d.dense_shape, d.expert_shape) == ((1, 4, 1, 2), (1, 1, 8, 1))
    assert P(8, dp_replicate=2, tp=2, ep=2).edp_shard == 2
    assert P(4, dp_shard=4, cp=1, tp=1).dp_shard == 4  # explicit sizes that already fill the world


def test_auto_cannot_divide():
    with raises("dp_shard='auto' cannot fill world_size=6: dp_replicate*cp*tp = 1*1*4 = 4 does not divide 6"):
        P(6, tp=4)
    with raises("product is in {1, 2, 3, 6}"):
        P(6, tp=4)


def test_plain_dataclass():
    d = P(8, tp=2, ep=4)
    assert dataclasses.asdict(d) == dict(dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=4, etp=1, world_size=8)
    assert dataclasses.replace(d, ep=8).edp_shard == 1
    assert d == P(8, tp=2, ep=4, dp_shard=4)


def test_product_not_world():
    with raises("dp_replicate*dp_shard*cp*tp = 1*2*1*4 = 8 != world_size=4"):
        P(4, dp_shard=2, tp=4)
    with raises("set dp_shard='auto'"):
        P(4, dp_shard=2, tp=1)


@pytest.mark.parametrize("name", ["dp_replicate", "dp_shard", "cp", "tp", "ep", "etp"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_non_positive_or_non_int_sizes(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be a positive int"):
        P(4, **{name: bad})


def test_bad_world_size_and_names():
    with raises("world_size must be a positive int, got 0"):
        ParallelDims(world_size=0)
    with raises("dp_shard must be a positive int, -1 or 'auto'"):
        P(4, dp_shard="half")
    with pytest.raises(TypeError, match="pp"):
        P(4, pp=2)


def test_expert_view_divisibility():
    # ep folds over one replica's dp_shard*cp*tp ranks: never over dp_replicate
    with raises("ep*etp = 4*1 = 4 must divide the 2 ranks of one data-parallel replica"):
        P(4, dp_replicate=2, ep=4)
    with raises("choose ep in {1, 2}"):
        P(4, dp_replicate=2, ep=4)
    with raises("choose ep in {1, 2} for etp=2"):
        P(4, ep=4, etp=2)
    with raises("etp=3 must divide the 4 ranks of one data-parallel replica"):
        P(4, etp=3)
    # folding: ep may exceed dp_shard by borrowing tp and cp ranks
    assert P(8, tp=2, ep=8).ep == 8
    assert P(4, cp=2, tp=2, ep=4).edp_shard == 1
    assert P(2, tp=2, ep=2).edp_shard == 1


# ---- sizes against a model and a sequence length -----------------------------------------------------
def tiny(**kw) -> ModelConfig:
    return ModelConfig.from_preset("tiny", **kw)


def test_valid_layouts_pass():
    cfg = tiny()
    for d in [P(1), P(8, tp=2, ep=8), P(4, dp_replicate=2, ep=2), P(4, tp=2, ep=2, etp=2), P(2, cp=2, ep=2),
              P(8, dp_replicate=2, cp=2, tp=2, ep=4)]:
        assert d.validate(cfg, seq_len=64) is d


def test_experts_not_divisible_by_ep():
    with raises("ep=3 does not divide num_experts=8: choose ep in {1, 2, 4}"):
        P(12, ep=3).validate(tiny())


def test_heads_not_divisible_by_tp():
    with raises("tp=8 does not divide num_heads=4 (tensor parallel splits attention heads): choose tp in {1, 2, 4}"):
        P(8, tp=8).validate(tiny())


def test_kv_heads_not_divisible_by_tp():
    cfg = tiny(num_heads=8, num_kv_heads=2, head_dim=16)
    with raises("tp=4 does not divide num_kv_heads=2 (GQA"):
        P(4, tp=4).validate(cfg)
    with raises("choose tp in {1, 2}"):
        P(4, tp=4).validate(cfg)
    P(4, tp=2).validate(cfg)


def test_mla_kv_heads_not_split():
    cfg = tiny(attention="mla", qk_norm="none", num_heads=4, num_kv_heads=1, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    P(4, ep=4).validate(cfg)  # num_kv_heads means nothing for MLA: no kv-head check without tp


def test_hidden_sizes_not_divisible_by_tp():
    with raises("tp=2 does not divide hidden_size=129"):
        P(2, tp=2).validate(tiny(hidden_size=129, num_heads=2, num_kv_heads=2, head_dim=64))
    dense = tiny(dense_hidden_size=258, num_kv_heads=4, moe=dict(num_experts=0))
    with raises("tp=4 does not divide dense_hidden_size=258 (the dense MLP is split over tp): choose tp in {1, 2}"):
        P(4, tp=4).validate(dense)
    # a MoE model without dense layers never uses dense_hidden_size
    P(4, tp=4, ep=4).validate(tiny(dense_hidden_size=258, num_kv_heads=4, moe=dict(first_k_dense=0)))
    # shared experts are replicated over tp (each tp rank runs them on its own tokens): any size is fine
    P(4, tp=4).validate(tiny(num_kv_heads=4, moe=dict(shared_expert_hidden_size=130)))


def test_tp_with_mla_splits_heads_and_full_qk_norm_is_rejected():
    mla = dict(attention="mla", qk_norm="none", kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16)
    P(2, tp=2).validate(tiny(num_kv_heads=1, **mla))  # kv heads mean nothing for MLA: only num_heads is split
    P(4, tp=4, ep=4).validate(tiny(num_kv_heads=1, q_lora_rank=24, **mla))
    with raises("tp=8 does not divide num_heads=4 (tensor parallel splits MLA's heads after its latent "
                "projections): choose tp in {1, 2, 4}, or num_heads a multiple of 8"):
        P(8, tp=8).validate(tiny(num_kv_heads=1, **mla))
    with raises("qk_norm='full' normalises over all heads and cannot be split by tp=2"):
        P(2, tp=2).validate(tiny(qk_norm="full"))


def test_etp_not_dividing_expert_hidden_size():
    with raises("etp=4 does not divide moe.expert_hidden_size=98 (expert tensor parallel splits each expert's "
                "hidden size): choose etp in {1, 2}"):
        P(4, etp=4).validate(tiny(moe=dict(expert_hidden_size=98)))


def test_expert_parallel_on_dense_model():
    dense = tiny(moe=dict(num_experts=0))
    with raises("the model is dense (moe.num_experts=0) but ep=2, etp=1: set ep=1 and etp=1"):
        P(2, ep=2).validate(dense)
    with raises("but ep=1, etp=2: set ep=1 and etp=1"):
        P(2, etp=2).validate(dense)
    P(2, tp=2).validate(dense)


def test_seq_len_constraints():
    with raises("seq_len=30 is not divisible by 2*cp = 4 (context parallel"):
        P(2, cp=2).validate(seq_len=30)
    with raises("make seq_len a multiple of 4, or choose cp in {1, 3, 5, 15}"):
        P(2, cp=2).validate(seq_len=30)
    P(2, cp=2).validate(seq_len=32)
    with raises("seq_len=31 is not divisible by 2 = tp=2 x cp=1 (sequence parallel"):
        P(2, tp=2).validate(seq_len=31)
    with raises("seq_len=36 is not divisible by 8 = tp=2 x 2*cp=4"):
        P(4, tp=2, cp=2).validate(seq_len=36)
    with raises("seq_len must be a positive int, got 0"):
        P(1).validate(seq_len=0)
    P(1).validate(seq_len=7)
    assert P(4, tp=2, cp=2).seq_len_divisor == 8


# ---- rank arithmetic (no process groups) ---------------------------------------------------------------
def test_batch_rank_layouts():
    d = P(8, tp=2)  # tp peers share a batch rank
    assert [d.batch_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert d.num_data_shards == 4
    d = P(4, dp_replicate=2, dp_shard=2)  # HSDP 2x2: four distinct shards
    assert [d.batch_rank(r) for r in range(4)] == [0, 1, 2, 3] and d.num_data_shards == 4
    d = P(4, dp_replicate=2, tp=2)
    assert [d.batch_rank(r) for r in range(4)] == [0, 0, 1, 1] and d.num_data_shards == 2
    d = P(8, cp=2, tp=2)  # cp and tp peers share
    assert [d.batch_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert P(2, cp=2, ep=2).num_data_shards == 1
    with raises("rank must be an int in [0, 8)"):
        P(8).batch_rank(8)


def test_ep_never_changes_batch_rank():
    base = [P(8, tp=2).batch_rank(r) for r in range(8)]
    for ep, etp in [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)]:
        d = P(8, tp=2, ep=ep, etp=etp)
        assert [d.batch_rank(r) for r in range(8)] == base
        assert d.num_data_shards == 4


def test_rank_groups_folding():
    d = P(2, tp=2, ep=2)  # the ep group IS the tp group
    assert d.rank_groups("ep") == d.rank_groups("tp") == [[0, 1]]
    d = P(8, tp=2, ep=8)  # attention tp=2 x dp_shard=4, experts over all 8 ranks
    assert d.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.rank_groups("dp_shard") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.rank_groups("ep") == [list(range(8))]
    assert d.rank_groups("edp_shard") == [[r] for r in range(8)]
    d = P(8, dp_replicate=2, tp=2, ep=2)
    assert d.rank_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.rank_groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.rank_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.coords(5, "expert") == {"dp_replicate": 1, "edp_shard": 0, "ep": 1, "etp": 0}
    assert d.coords(6, "dense") == {"dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 0}
    assert d.group_ranks("cp_tp", 5) == [4, 5]
    with raises("unknown mesh dim 'pp'"):
        d.rank_groups("pp")


def test_flags_describe_and_unbuilt_getters():
    d = P(8, dp_replicate=2, tp=2, ep=4)
    assert (d.dp_replicate_enabled, d.dp_shard_enabled, d.cp_enabled, d.tp_enabled) == (True, True, False, True)
    assert (d.ep_enabled, d.etp_enabled, d.fsdp_enabled, d.expert_fsdp_enabled) == (True, False, True, False)
    text = d.describe()
    assert "dense : dp_replicate=2 x dp_shard=2 x cp=1 x tp=2" in text
    assert "expert: dp_replicate=2 x edp_shard=1 x ep=4 x etp=1" in text
    assert "batch : dp_replicate=2 x dp_shard=2 = 4 data shards" in text
    with pytest.raises(RuntimeError, match="build_meshes"):
        d.tp_mesh
    with pytest.raises(RuntimeError, match="build_meshes"):
        d.fsdp_mesh()
    one = P(1)
    assert one.token_group is None and one.global_group is None  # no process group needed on one process
    assert not (one.fsdp_enabled or one.tp_enabled or one.ep_enabled)


# ---- real meshes on gloo ranks ---------------------------------------------------------------------------
# For each layout: every group of each dim, written out by hand.
LAYOUTS = [
    (dict(dp_shard=4, ep=2), {
        "tp": [[0], [1], [2], [3]], "cp": [[0], [1], [2], [3]], "ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]],
        "edp_shard": [[0, 2], [1, 3]], "dp_shard_cp": [[0, 1, 2, 3]], "dp": [[0, 1, 2, 3]],
        "cp_tp": [[0], [1], [2], [3]], "world": [[0, 1, 2, 3]],
    }),
    (dict(dp_replicate=2, dp_shard=2, ep=2), {
        "tp": [[0], [1], [2], [3]], "cp": [[0], [1], [2], [3]], "ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]],
        "dp_replicate": [[0, 2], [1, 3]], "edp_shard": [[0], [1], [2], [3]], "dp_shard_cp": [[0, 1], [2, 3]],
        "dp": [[0, 1, 2, 3]], "edp": [[0, 2], [1, 3]], "world": [[0, 1, 2, 3]],
    }),
    (dict(tp=2, dp_shard=2, ep=2, etp=2), {
        "tp": [[0, 1], [2, 3]], "cp": [[0], [1], [2], [3]], "ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]],
        "dp_shard": [[0, 2], [1, 3]], "edp_shard": [[0], [1], [2], [3]], "dp_shard_cp": [[0, 2], [1, 3]],
        "dp": [[0, 2], [1, 3]], "cp_tp": [[0, 1], [2, 3]], "ep_etp": [[0, 1, 2, 3]], "world": [[0, 1, 2, 3]],
    }),
    (dict(cp=2, ep=2), {  # W=2
        "tp": [[0], [1]], "cp": [[0, 1]], "ep": [[0, 1]], "etp": [[0], [1]], "dp_shard_cp": [[0, 1]],
        "dp": [[0], [1]], "dp_cp": [[0, 1]], "cp_tp": [[0, 1]], "edp_shard": [[0], [1]], "world": [[0, 1]],
    }),
]


def _mine(groups, rank):
    return next(g for g in groups if rank in g)


def _pg_ranks(group):
    return dist.get_process_group_ranks(group)


def _check_layout(rank, W, sizes, expected):
    d = ParallelDims(world_size=W, **sizes).build_meshes("cpu")
    assert d.dense_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")
    assert d.expert_mesh.mesh_dim_names == ("dp_replicate", "edp_shard", "ep", "etp")
    assert tuple(d.dense_mesh.shape) == d.dense_shape and tuple(d.expert_mesh.shape) == d.expert_shape
    getters = {"tp": d.tp_mesh, "cp": d.cp_mesh, "ep": d.ep_mesh, "etp": d.etp_mesh, "dp": d.batch_mesh}
    for name, groups in expected.items():
        mesh = getters.get(name) or d.mesh(name)
        assert _pg_ranks(mesh.get_group()) == _mine(groups, rank), (sizes, name)
        assert d.rank_groups(name) == groups, (sizes, name)  # the pure arithmetic agrees
    for name in ["dp_replicate", "dp_shard", "cp", "tp", "edp_shard", "ep", "etp", "dp", "dp_shard_cp", "dp_cp",
                 "cp_tp", "world", "edp", "ep_etp"]:
        assert _pg_ranks(d.group(name)) == d.group_ranks(name, rank), (sizes, name)

    # FSDP meshes: HSDP is 2-D (replicate, shard), else 1-D shard
    fm, efm = d.fsdp_mesh(), d.expert_fsdp_mesh()
    if d.dp_replicate > 1:
        assert fm.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        assert efm.mesh_dim_names == ("dp_replicate", "edp_shard")
        assert _pg_ranks(fm.get_group("dp_replicate")) == d.group_ranks("dp_replicate", rank)
        assert _pg_ranks(efm.get_group("dp_replicate")) == d.group_ranks("dp_replicate", rank)
        assert _pg_ranks(fm.get_group("dp_shard_cp")) == _mine(expected["dp_shard_cp"], rank)
        assert _pg_ranks(efm.get_group("edp_shard")) == _mine(expected["edp_shard"], rank)
    else:
        assert fm.mesh_dim_names == ("dp_shard_cp",) and efm.mesh_dim_names == ("edp_shard",)
        assert _pg_ranks(fm.get_group()) == _mine(expected["dp_shard_cp"], rank)
        assert _pg_ranks(efm.get_group()) == _mine(expected["edp_shard"], rank)

    # collectives reach exactly the expected ranks
    def allreduce(group, members):
        t = torch.tensor([2.0**rank])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(2.0**r for r in members), (sizes, members, t.item())

    allreduce(d.ep_mesh.get_group(), _mine(expected["ep"], rank))
    allreduce(d.etp_mesh.get_group(), _mine(expected["etp"], rank))
    if d.token_group_size > 1:
        allreduce(d.token_group, _mine(expected["cp_tp"], rank))
    else:
        assert d.token_group is None
    allreduce(d.global_group, list(range(W)))
    return d


def _fsdp_smoke(rank, d):
    """FSDP2 accepts the getters' meshes: dense params TP'd on tp_mesh + fsdp_mesh(); expert params
    Shard(0) over ep (x Shard(1) over etp) + expert_fsdp_mesh(); expert grads average over edp ranks only."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 8, bias=False)
    w_full = lin.weight.detach().clone()
    if d.tp > 1:
        parallelize_module(lin, d.tp_mesh, ColwiseParallel())
    fully_shard(lin, mesh=d.fsdp_mesh())
    assert torch.equal(lin.weight.full_tensor(), w_full)

    E, F, D = 4, 4, 2
    w = torch.randn(E, F, D)
    if d.etp > 1:
        dt = distribute_tensor(w, d.expert_mesh["ep", "etp"], [Shard(0), Shard(1)])
    else:
        dt = distribute_tensor(w, d.ep_mesh, [Shard(0)])

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(dt)

        def forward(self):
            return self.w.to_local().sum() * (rank + 1)

    m = Experts()
    fully_shard(m, mesh=d.expert_fsdp_mesh())
    assert torch.equal(m.w.full_tensor(), w)
    m().backward()
    g = m.w.grad.full_tensor()
    # element (e, f) lives on the ranks with that ep/etp coordinate; FSDP averages over them (edp x dp_replicate)
    want = torch.empty(E, F, D)
    for e in range(E):
        for f in range(F):
            holders = [r for r in range(d.world_size)
                       if d.coords(r, "expert")["ep"] == e // (E // d.ep)
                       and d.coords(r, "expert")["etp"] == f // (F // d.etp)]
            want[e, f] = sum(r + 1 for r in holders) / len(holders)
    assert torch.equal(g, want), (g, want)


def _mesh_worker(rank, W, layouts, fsdp=False):
    for sizes, expected in layouts:
        d = _check_layout(rank, W, sizes, expected)
        if fsdp:  # importing FSDP2/TP costs seconds per process: only on the 4-rank layouts
            _fsdp_smoke(rank, d)
    with pytest.raises(ValueError, match=f"process group has {W} ranks: rebuild ParallelDims with world_size={W}"):
        ParallelDims(world_size=2 * W).build_meshes("cpu")
    return True


def test_meshes_four_ranks():
    assert run_distributed(_mesh_worker, 4, LAYOUTS[:3], True)


def test_meshes_two_ranks_cp_ep():
    assert run_distributed(_mesh_worker, 2, LAYOUTS[3:])
