"""DeepEP dispatcher (``dispatcher="deepep"``) on CPU: its error paths, the layout conversion, and the whole
dispatch -> experts -> combine path (values and gradients) through a pure-torch stand-in of ``deep_ep.Buffer``.

DeepEP itself cannot run here (CUDA kernels over NVLink). ``FakeBuffer`` below, used ONLY by these tests, mirrors
the semantics our dispatcher relies on, from DeepEP commit 567632d (``deep_ep/buffer.py`` ``Buffer`` and
``csrc/kernels/intranode.cu``), over gloo ``all_to_all_single``:

* ``get_dispatch_layout(topk_idx, E)``: tokens per rank [P] and per expert [E] (int32), None for the RDMA ranks,
  ``is_token_in_rank`` [T, P] (a token goes to a rank if any of its top-k ids, -1 = none, is on it);
* ``dispatch`` (non-cached, with top-k): every token travels ONCE to each rank in ``is_token_in_rank``; the
  received rows are source-rank major, tokens in their order; ``topk_idx`` rewritten to the receiver's local ids
  (-1 for experts elsewhere, ``notify``/``dispatch`` kernels), ``topk_weights`` zeroed there; the per-local-expert
  counts are the senders' ``num_tokens_per_expert`` summed over sources and rounded up to ``expert_alignment``,
  a host list; a handle;
* ``dispatch(x, handle=...)`` (cached): the same movement of new rows, nothing else;
* ``combine(x, handle, topk_weights=None)``: per source token, the sum over the ranks it went to of their rows
  (fp32 accumulation, cast to the rows' dtype) and of their top-k weights; zeros for a token sent nowhere.

Not mirrored: channels, queues, SM counts, streams and events, FP8, buffer sizes, the bf16-only restriction (the
fake also carries fp32, so the layer can be compared with the all-to-all dispatcher to fp32 rounding). The real
kernels are checked on 2 GPUs by ``bench/deepep_check.py`` (outputs and gradients against the all-to-all dispatcher
at a bf16 tolerance); until that has run, only this CPU contract is verified.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import _lane as lane
from _dist import run_distributed
from lightning_moe.config import MoEConfig
from lightning_moe.moe.dispatch import deepep
from lightning_moe.moe.dispatch.deepep import (
    DEEPEP_COMMIT,
    DeepEPDispatcher,
    check_deepep_nodes,
    check_deepep_sizes,
    received_layout,
)
from lightning_moe.moe.dispatch import AllToAllDispatcher, LocalDispatcher
from lightning_moe.moe.layer import MoELayer
from lightning_moe.moe.router import RoutingResult


class _Event:
    def current_stream_wait(self) -> None:
        pass


class _Config:
    """Stand-in of deep_ep.Config: buffer size hints proportional to the row bytes (for the cache test)."""

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 1000 * hidden_bytes * num_ranks

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class FakeBuffer:
    """Pure-torch stand-in of ``deep_ep.Buffer``'s intranode normal mode (see the module docstring)."""

    num_sms = 20
    created: list["FakeBuffer"] = []

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 dtypes=(torch.float32, torch.bfloat16)) -> None:
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.dtypes = dtypes
        FakeBuffer.created.append(self)

    @staticmethod
    def set_num_sms(n: int) -> None:
        FakeBuffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        return _Config()

    get_combine_config = get_dispatch_config

    def _a2a(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv, send, group=self.group)
        return out

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        P, e = self.group_size, num_experts // self.group_size
        rank_TK = torch.where(topk_idx >= 0, topk_idx // e, torch.full_like(topk_idx, -1))
        in_rank = torch.stack([(rank_TK == r).any(1) for r in range(P)], dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, _Event()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        if handle is not None:  # cached mode: rows only
            assert topk_idx is None and topk_weights is None
            tok, send, recv, _ = handle
            return self._a2a(x[tok], send, recv), None, None, None, None, _Event()
        P = self.group_size
        e = num_tokens_per_expert.numel() // P
        rows = [is_token_in_rank[:, r].nonzero().squeeze(1) for r in range(P)]  # token order
        send = [int(t.numel()) for t in rows]
        recv_n = torch.empty(P, dtype=torch.long)
        dist.all_to_all_single(recv_n, torch.tensor(send), group=self.group)
        recv = recv_n.tolist()
        tok = torch.cat(rows)
        local = [(topk_idx[t] >= r * e) & (topk_idx[t] < (r + 1) * e) for r, t in enumerate(rows)]
        ids = torch.cat([torch.where(m, topk_idx[t] - r * e, torch.full_like(topk_idx[t], -1))
                         for r, (t, m) in enumerate(zip(rows, local))])
        w = torch.cat([torch.where(m, topk_weights[t], torch.zeros_like(topk_weights[t])) for t, m in zip(rows, local)])
        # the notify kernel: the senders' per-expert counts of this rank's experts, summed, aligned
        per_src = torch.empty_like(num_tokens_per_expert)
        dist.all_to_all_single(per_src, num_tokens_per_expert, group=self.group)
        counts = [(c + expert_alignment - 1) // expert_alignment * expert_alignment
                  for c in per_src.view(P, e).sum(0).tolist()]
        handle = (tok, send, recv, x.shape[0])
        return (self._a2a(x[tok], send, recv), self._a2a(ids, send, recv), self._a2a(w, send, recv), counts, handle,
                _Event())

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        tok, send, recv, T = handle
        back = self._a2a(x, recv, send)
        out = torch.zeros(T, x.shape[1]).index_add_(0, tok, back.float()).to(x.dtype)
        w_out = None
        if topk_weights is not None:
            w_back = self._a2a(topk_weights, recv, send)
            w_out = torch.zeros(T, topk_weights.shape[1]).index_add_(0, tok, w_back)
        return out, w_out, _Event()


def _fake_deep_ep(buffer_cls=FakeBuffer) -> types.ModuleType:
    mod = types.ModuleType("deep_ep")
    mod.Buffer = buffer_cls
    mod.topk_idx_t = torch.int64
    return mod


# ---------------------------------------------------------------------------------------------------- errors


def _assert_names_recipe(err: BaseException) -> None:
    msg = str(err)
    assert DEEPEP_COMMIT[:7] in msg and "docs/deepep.md" in msg and "pip wheel" in msg, msg


def test_strategy_without_deep_ep_names_the_recipe(monkeypatch):
    from lightning_moe import MoEParallelStrategy

    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError, installed or not
    with pytest.raises(RuntimeError, match="needs the deep_ep package") as info:
        MoEParallelStrategy(ep=2, dispatcher="deepep")
    _assert_names_recipe(info.value)
    with pytest.raises(RuntimeError, match="needs the deep_ep package") as info:
        DeepEPDispatcher(None)
    _assert_names_recipe(info.value)


def test_stale_deep_ep_is_refused(monkeypatch):
    """PyPI's old snapshot, or anything without the V1 Buffer API we call: a missing method at import, a dispatch
    without the V1 keywords (expert_alignment) at its first call, before anything runs; other TypeErrors pass."""

    NoCombine = type("NoCombine", (), {k: v for k, v in vars(FakeBuffer).items() if k != "combine"})
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep(NoCombine))
    with pytest.raises(RuntimeError, match=r"lacks the V1 Buffer API this backend calls \(combine\)") as info:
        DeepEPDispatcher(None)
    _assert_names_recipe(info.value)
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    with pytest.raises(RuntimeError, match="lacks the V1 Buffer API"):
        deepep.import_deep_ep()

    class OldBuffer:
        def get_dispatch_layout(self, topk_idx, num_experts):
            return None, None, None, None, None

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None):
            raise AssertionError("not reached: the call's binding fails first")  # no expert_alignment

    x, probs, ids = torch.randn(3, 8), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"lacks the V1 Buffer API.*expert_alignment") as info:
        deepep._Dispatch.apply(x, probs, ids, 4, 1, deepep._DeepEPState(OldBuffer()))
    _assert_names_recipe(info.value)

    def kernel_error(self, x, **kwargs):
        raise TypeError("a kernel's own argument error")

    OldBuffer.dispatch = kernel_error
    with pytest.raises(TypeError, match="a kernel's own argument error"):
        deepep._Dispatch.apply(x, probs, ids, 4, 1, deepep._DeepEPState(OldBuffer()))


def test_no_cuda_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        DeepEPDispatcher(None)


def test_sizes_and_nodes():
    check_deepep_sizes(1, 1)
    for ep in (2, 4, 8):
        check_deepep_sizes(ep, 1)
    with pytest.raises(ValueError, match="etp=1"):
        check_deepep_sizes(2, 2)
    with pytest.raises(ValueError, match="ep in"):
        check_deepep_sizes(3, 1)
    with pytest.raises(ValueError, match="ep in"):
        check_deepep_sizes(16, 1)
    check_deepep_nodes([[0, 1], [2, 3]], 2)
    with pytest.raises(ValueError, match="span nodes"):
        check_deepep_nodes([[0, 1, 2, 3]], 2)


def test_strategy_checks(monkeypatch):
    """With the package present: etp rejected at construction; at setup, CUDA, one node per ep group and bf16
    activations (precision), each with the fix."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from lightning_moe import MoEParallelStrategy
    from lightning_moe.parallel.dims import ParallelDims

    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep())
    with pytest.raises(ValueError, match="etp"):
        MoEParallelStrategy(ep=2, etp=2, dispatcher="deepep")
    gpus = [torch.device("cuda", i) for i in range(4)]

    def check(precision, devices=gpus, param_dtype=None, ep=2):
        s = MoEParallelStrategy(ep=ep, dispatcher="deepep", parallel_devices=devices, precision_plugin=precision,
                                param_dtype=param_dtype)
        s._check_deepep(ParallelDims(world_size=len(devices), ep=ep))

    check(HalfPrecision("bf16-true"))
    check(Precision(), param_dtype="bf16")  # FSDP2 casts parameters and inputs to bf16
    check(HalfPrecision("bf16-true"), ep=4)
    for bad in (Precision(), MixedPrecision("bf16-mixed", "cuda")):
        with pytest.raises(ValueError, match="bf16-true"):
            check(bad)
    with pytest.raises(RuntimeError, match="CUDA"):
        check(HalfPrecision("bf16-true"), devices=[torch.device("cpu")] * 2)


# ---------------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("align", [1, 4])
def test_received_layout(align):
    """DeepEP's received rows (local ids, -1 elsewhere) -> expert-grouped rows: with alignment 1 exactly
    LocalDispatcher's layout of the same rows (ids -1 as dropped assignments); aligned, the same rows with zero-row
    padding at the end of each expert."""
    g = torch.Generator().manual_seed(0)
    N, k, e = 11, 3, 4
    ids = torch.randint(0, e, (N, k), generator=g)
    ids[torch.rand(N, k, generator=g) < 0.4] = -1
    ids[2] = -1  # a row with nothing here (cannot come from DeepEP, harmless)
    true = torch.bincount(ids[ids >= 0], minlength=e)
    counts = [(int(c) + align - 1) // align * align for c in true]
    pos, asg = received_layout(ids, counts)
    assert asg.shape == (sum(counts),) and pos.shape == (N, k)

    keep = ids >= 0
    routing = RoutingResult(torch.rand(N, k, generator=g), ids.clamp(min=0), true, torch.zeros(()), torch.zeros(()),
                            keep_mask=keep, capacity=None)
    counts_l, ctx = LocalDispatcher().layout(routing, e)
    assert counts_l.tolist() == true.tolist()
    if align == 1:
        assert torch.equal(asg, ctx.asg_R) and torch.equal(pos, ctx.pos_TK)
        return
    start = 0
    for j in range(e):
        block = asg[start:start + counts[j]]
        n = int(true[j])
        assert torch.equal(block[:n], ctx.asg_R[int(true[:j].sum()):int(true[:j + 1].sum())])
        assert (block[n:] == -1).all()
        start += counts[j]
    for a in range(N * k):  # pos is asg's inverse
        r = int(pos.view(-1)[a])
        assert (r == -1) == (not bool(keep.view(-1)[a])) and (r == -1 or int(asg[r]) == a)


# ---------------------------------------------------------------------------------------------------- multi-rank


def _dispatcher_worker(rank, world):
    """DeepEPDispatcher + FakeBuffer against the formula (the cases of tests/test_dispatcher.py: uneven T with an
    empty rank, an expert with no tokens, k = E, capacity drops), weights in the combine or in the experts, with and
    without an expert alignment; then the bf16-only error and the per-group Buffer cache."""
    from test_dispatcher import CASES, D, _check_case, _layouts

    for name, ep, etp in _layouts(world):
        if etp is not None and etp.size() > 1:
            continue  # deepep: etp = 1 only
        group = ep if isinstance(ep, dist.ProcessGroup) else ep.get_group()
        for align in (1, 3):
            disp = DeepEPDispatcher(ep, etp, buffer=FakeBuffer(group), expert_alignment=align)
            for case in CASES:
                if case["E"] % disp.ep_size:
                    continue
                for row_probs in (False, True):
                    try:
                        _check_case(disp, case, world, row_probs=row_probs)
                    except Exception as err:
                        raise AssertionError(f"{name}, {case['name']}, {disp!r}, row_probs={row_probs}: {err}") from err
    disp = DeepEPDispatcher(dist.group.WORLD, buffer=FakeBuffer(dist.group.WORLD, dtypes=(torch.bfloat16,)))
    routing = RoutingResult(torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), torch.ones(1), torch.zeros(()),
                            torch.zeros(()))
    try:
        disp.dispatch(torch.zeros(1, D), routing, 2 * world)
    except ValueError as err:
        assert "bf16-true" in str(err), err
    else:
        raise AssertionError("fp32 activations were accepted by a bf16-only buffer")
    _check_buffer_cache(world)
    return True


def _check_buffer_cache(world):
    """get_buffer: one Buffer per group, sized from the config hints, reused; a wider row replaces it."""
    sys.modules["deep_ep"] = _fake_deep_ep()  # this rank's process only
    group = dist.new_group(list(range(world)))
    b1 = deepep.get_buffer(group, 64)
    assert deepep.get_buffer(group, 64) is b1 and deepep.get_buffer(group, 32) is b1
    assert b1.num_nvl_bytes == 1000 * 64 * world and b1.num_rdma_bytes == 0 and b1.group is group
    b2 = deepep.get_buffer(group, 128)
    assert b2 is not b1 and b2.num_nvl_bytes == 1000 * 128 * world
    assert deepep.get_buffer(dist.group.WORLD, 64) is not b2  # another group, another buffer


@pytest.mark.parametrize("world", [2, 4])
def test_deepep_dispatcher_matches_single_process(world):
    assert run_distributed(_dispatcher_worker, world) is True


LAYER_D = 32
LAYER_CASES = [
    dict(num_experts=8, top_k=2, expert_hidden_size=16),
    dict(num_experts=4, top_k=3, expert_hidden_size=16, capacity_factor=0.6, shared_expert_hidden_size=8),
]


def _layer_worker(rank, world):
    """The MoE layer under ep=world: DeepEPDispatcher + FakeBuffer against AllToAllDispatcher, same weights and
    tokens: output, input gradient and every parameter's gradient (expert shards, router) to fp32 rounding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_moe.parallel.parallelize import _shard_param

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    for i, cfg in enumerate(LAYER_CASES):
        torch.manual_seed(0)
        ref = MoELayer(MoEConfig(**cfg), LAYER_D)
        with torch.no_grad():  # O(1) outputs and gradients
            for p in ref.parameters():
                p.normal_(0.0, 0.3)
        torch.manual_seed(100 + rank)  # every rank its own tokens (and, in the second case, padding)
        x0, up = torch.randn(2, 12, LAYER_D), torch.randn(2, 12, LAYER_D)
        valid = (torch.rand(2, 12) > 0.2) if i == 1 else None
        out = {}
        for kind in ("alltoall", "deepep"):
            layer = copy.deepcopy(ref)
            for w in ("w1", "w3", "w2"):
                _shard_param(layer.experts, w, mesh, [Shard(0)])
            layer.replan(dispatcher=AllToAllDispatcher(mesh["ep"]) if kind == "alltoall"
                         else DeepEPDispatcher(mesh["ep"], buffer=FakeBuffer(mesh.get_group())))
            x = x0.clone().requires_grad_()
            y = layer(x, valid)
            (y * up).sum().backward()
            grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                     for n, p in layer.named_parameters()}
            out[kind] = dict(y=y.detach(), x=x.grad, **grads)
        a, b = out["alltoall"], out["deepep"]
        assert set(a) == set(b)
        for name in a:
            assert a[name] is not None and b[name] is not None, name
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, c=i: f"case {c}, {n}: {m}")
    return True


def test_layer_deepep_equals_alltoall():
    assert run_distributed(_layer_worker, 2) is True


@lane.job
def _bench_smoke(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, Path]:
    repo = Path(__file__).resolve().parent.parent
    out = tmp / "deepep_check.json"
    env = dict(env, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    return lane.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     str(repo / "bench" / "deepep_check.py"), "--cpu", "--small", "--shapes", "deepseek_v3",
                     "--routing", "learned", "--iters", "1", "--warmup", "1", "--out", str(out)],
                    cwd=repo, env=env, timeout=300), out


def test_bench_script_cpu_smoke():
    """bench/deepep_check.py (the GPU check a later session runs) on 2 gloo ranks with FakeBuffer: it runs, and its
    check passes."""
    proc, out = lane.result(_bench_smoke)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["check"]["ok"] and set(res["runs"]) == {"alltoall", "deepep"}, res
