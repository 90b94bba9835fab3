"""The LM loss over a vocabulary-sharded output projection (tensor parallel): Megatron's vocab-parallel cross-entropy.

Legend: N tokens (the whole micro-batch of the tp group), D hidden, V vocabulary, v this rank's vocabulary shard
(V / tp), C tokens of one chunk.

Under tensor parallelism the LM head's weight is ``Shard(0)`` over tp (the output projection column-parallel, or the
tied embedding row-parallel: both split the vocabulary rows). Every tp rank gathers the sequence-parallel hidden
states (all N tokens, [N, D]) and computes the logits of its own vocabulary shard only, C tokens at a time, in the
chunked loop of :mod:`lightning_moe.models.lm_loss`. The softmax's statistics are combined over tp per chunk: one
fp32 all-reduce (max) of the [C] row maxima, one (sum) of [2, C]: the sum of exp(logit - max) and the target logit
(held by the one rank whose shard contains the label). Every rank then holds the loss of all N tokens, as one
process would; the largest temporary is [C, v], never [N, V]. The input gradient is partial per rank (its shard's
contribution): DTensor sums it over tp in the backward of the sequence gather (a reduce-scatter).

``loss_impl``: ``"auto"`` and ``"chunked"`` run this on every device; ``"torch"`` is the reference (the local
logits gathered to [N, V] on every rank, then ``F.cross_entropy``); ``"liger"`` has no vocab-parallel form (a
ValueError).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_moe.models.lm_loss import (IGNORE_INDEX, chunk_tokens_for, chunked_linear_cross_entropy,
                                          compiled_on_cuda, resolve_loss_impl, token_loss_sum)

__all__ = ["VocabParallelLoss", "vocab_shard"]


def vocab_shard(V: int, tp: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of tp rank ``rank``'s shard of V vocabulary rows under ``Shard(0)`` (torch.chunk's split:
    ceil(V / tp) rows a rank, the last ranks shorter)."""
    per = -(-V // tp)
    start = min(rank * per, V)
    return start, min(per, V - start)


class VocabParallelLoss:
    """The model's LM loss seam under tensor parallelism (installed by ``parallelize.apply_tp``); called as
    ``(h_BSD, w_VD, labels_BS, impl)`` with ``h_BSD`` the final norm's output (a DTensor ``Shard(1)`` over tp: sequence
    parallel) and ``w_VD`` the LM head's weight (a DTensor ``Shard(0)`` over tp). ``chunk_tokens`` overrides the
    chunk size (default: fp32 logits of one chunk of about 2 GiB of the shard, the same on every tp rank)."""

    def __init__(self, tp_mesh: DeviceMesh, chunk_tokens: Optional[int] = None) -> None:
        self.tp_mesh, self.chunk_tokens = tp_mesh, chunk_tokens

    def __call__(self, h_BSD: Tensor, w_VD: Tensor, labels_BS: Tensor, impl: str) -> Tensor:
        if impl == "liger":
            raise ValueError("loss_impl='liger' has no vocab-parallel form under tensor parallelism (tp > 1): use "
                             "loss_impl='chunked' (the default 'auto' picks it), which never gathers the logits")
        impl = resolve_loss_impl(impl, labels_BS.device) if impl != "auto" else "chunked"
        assert isinstance(h_BSD, DTensor) and isinstance(w_VD, DTensor), "the tp plan hands the LM head DTensors"
        assert tuple(w_VD.placements) == (Shard(0),) and w_VD.device_mesh == self.tp_mesh, w_VD.placements
        dev = labels_BS.device.type
        if impl == "chunked" and torch.is_autocast_enabled(dev):
            # as linear_cross_entropy: the chunked path does its own precision, on the autocast dtype
            dtype = torch.get_autocast_dtype(dev)
            with torch.autocast(dev, enabled=False):
                return self(h_BSD.to(dtype), w_VD, labels_BS, impl)
        # every rank: all N tokens (the sequence gathered; backward sums the partial input gradients over tp and
        # hands each rank its own sequence shard), its own vocabulary rows
        h_ND = h_BSD.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()]).flatten(0, 1)
        w_vD = w_VD.to(h_ND.dtype).to_local()
        labels_N = labels_BS.flatten()
        V, tp, rank = w_VD.shape[0], self.tp_mesh.size(), self.tp_mesh.get_local_rank()
        start, rows = vocab_shard(V, tp, rank)
        assert w_vD.shape[0] == rows, (w_vD.shape, V, tp, rank)
        if rows == 0:
            raise ValueError(f"vocab_size={V} split over tp={tp} leaves tp rank {rank} no vocabulary rows "
                             f"(Shard(0) gives each rank ceil(V / tp) rows): use a smaller tp")
        if impl == "torch":
            logits_NV = DTensor.from_local(h_ND @ w_vD.t(), self.tp_mesh, [Shard(1)], run_check=False,
                                           shape=(h_ND.shape[0], V), stride=(V, 1)).full_tensor()
            return token_loss_sum(logits_NV, labels_N)
        C = self.chunk_tokens or chunk_tokens_for(-(-V // tp))  # one size on every rank: they meet per chunk
        ce = functools.partial(_vocab_shard_ce, start=start, group=self.tp_mesh.get_group())
        return chunked_linear_cross_entropy(h_ND, w_vD, labels_N, C, ce)


def _vocab_shard_ce(logits_Cv: Tensor, labels_C: Tensor, want_grad: bool, *, start: int,
                    group: dist.ProcessGroup) -> tuple[Tensor, Optional[Tensor]]:
    """The chunk's loss sum over all vocabulary shards (the same on every tp rank) and d(sum)/d(local logits)."""
    v = logits_Cv.shape[1]
    valid_C = labels_C != IGNORE_INDEX
    local_C = labels_C - start
    own_C = valid_C & (local_C >= 0) & (local_C < v)  # the label's row is in this shard
    tgt_C1 = torch.where(own_C, local_C, 0).unsqueeze(1)
    max_C = logits_Cv.detach().amax(dim=-1).float()
    dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=group)
    stats_2C = _sumexp_and_target(logits_Cv, max_C, tgt_C1, own_C)
    dist.all_reduce(stats_2C, group=group)
    sumexp_C, target_C = stats_2C[0], stats_2C[1]
    loss = torch.where(valid_C, max_C + sumexp_C.log() - target_C, 0.0).sum()
    if not want_grad:
        return loss, None
    return loss, _shard_grad(logits_Cv, max_C, sumexp_C, tgt_C1, own_C, valid_C)


@compiled_on_cuda
def _sumexp_and_target(logits_Cv: Tensor, max_C: Tensor, tgt_C1: Tensor, own_C: Tensor) -> Tensor:
    """[2, C] fp32: this shard's sum of exp(logit - max), and the target logit where the shard holds it (else 0)."""
    x_Cv = logits_Cv.float()
    sumexp_C = torch.exp(x_Cv - max_C.unsqueeze(1)).sum(dim=-1)
    target_C = torch.where(own_C, x_Cv.gather(1, tgt_C1).squeeze(1), 0.0)
    return torch.stack([sumexp_C, target_C])


@compiled_on_cuda
def _shard_grad(logits_Cv: Tensor, max_C: Tensor, sumexp_C: Tensor, tgt_C1: Tensor, own_C: Tensor,
                valid_C: Tensor) -> Tensor:
    """Softmax over the whole vocabulary restricted to this shard, minus the one-hot label where the shard holds it,
    zero on ignored tokens; in the logits' dtype."""
    p_Cv = torch.exp(logits_Cv.float() - max_C.unsqueeze(1)) / sumexp_C.unsqueeze(1)
    p_Cv = p_Cv.scatter_add(1, tgt_C1, -own_C.to(p_Cv.dtype).unsqueeze(1))
    return torch.where(valid_C.unsqueeze(1), p_Cv, 0.0).to(logits_Cv.dtype)
