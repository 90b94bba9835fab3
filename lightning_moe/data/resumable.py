"""Data loading that resumes mid-epoch: a ``DistributedSampler`` whose epoch can start at a global position, and a
``DataLoader`` that saves and restores that position (Lightning's loops call its ``state_dict`` /
``load_state_dict``)."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` (Lightning keeps it) whose epoch can start at a global position.

    Iterating yields exactly what ``DistributedSampler`` yields (the epoch's global order, cut to a multiple of
    ``num_replicas`` with ``drop_last``, else padded by repeating its head; rank ``r`` reads positions ``r, r+R,
    ...``), except that an epoch restored by :meth:`resume_at` starts at global position ``start``: the rank then
    reads positions ``start + r, start + r + R, ...`` (when ``start`` is not a multiple of ``R``, after a change
    of layout, the rest is cut or padded again to a multiple of ``R``). ``len()`` stays the whole epoch's count,
    as Lightning counts the batches of a resumed epoch from the epoch's start.

    The loader that iterates it (:class:`ResumableDataLoader`) reports how many samples it handed out
    (:meth:`position` is then the global position of the next sample).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: Optional[tuple[int, int]] = None  # (epoch, start) for the next iteration, from a checkpoint
        self._iter_epoch: Optional[int] = None  # the running iteration: epoch, start, samples of this rank
        self._iter_start = 0
        self._iter_len = 0
        self._consumed = 0  # samples of the running iteration handed out on this rank
        self._epoch_offset = 0  # data epoch - Lightning's epoch (see set_epoch)

    def global_order(self) -> list[int]:
        """The epoch's global order of dataset indices (``total_size`` of them), as ``DistributedSampler``."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.drop_last:
            return order[: self.total_size]
        return _pad(order, self.total_size)

    def resume_at(self, epoch: int, start: int) -> None:
        """Start the next iteration in data epoch ``epoch`` at global position ``start`` (once)."""
        self._pending = (int(epoch), int(start))
        self.epoch = int(epoch)  # for loaders whose workers draw indices before Lightning's set_epoch

    def set_epoch(self, epoch: int) -> None:
        """Lightning's epoch counter, mapped onto the data epoch (the number of finished passes over the data).

        They agree, except after a resume from a checkpoint that Lightning wrote after ``max_steps`` stopped it
        mid-epoch (``trainer.save_checkpoint`` after ``fit``): Lightning counts that epoch as finished and resumes
        with the next epoch number at the saved batch index. The first ``set_epoch`` after :meth:`resume_at` fixes
        the offset between the two counters, so the data goes on in the checkpoint's epoch and then the next one,
        as in the uninterrupted run.
        """
        if self._pending is not None:
            self._epoch_offset = self._pending[0] - int(epoch)
        super().set_epoch(int(epoch) + self._epoch_offset)

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._pending is not None:
            _, start = self._pending  # resume_at / set_epoch made self.epoch the pending epoch
            self._pending = None
        order = self.global_order()
        rest = order[start:]
        R = self.num_replicas
        if len(rest) % R:  # only after a change of layout that moved the global batch boundaries
            rest = rest[: len(rest) - len(rest) % R] if self.drop_last else rest + _pad(order, R - len(rest) % R)
        self._iter_epoch, self._iter_start, self._iter_len, self._consumed = self.epoch, start, len(rest) // R, 0
        return iter(rest[self.rank :: R])

    def _handed_out(self, count: int) -> None:
        self._consumed = min(self._consumed + count, self._iter_len)

    def _new_iteration(self) -> None:
        """A new loader iteration begins (nothing of it consumed yet); the sampler itself runs on the first batch."""
        self._iter_epoch = None

    def position(self) -> tuple[int, int]:
        """``(epoch, global position of the next sample)``: the same on every rank of the batch view."""
        if self._pending is not None:
            return self._pending
        if self._iter_epoch is None:
            return self.epoch, 0
        return self._iter_epoch, self._iter_start + self._consumed * self.num_replicas


def _pad(order: list[int], size: int) -> list[int]:
    """``order`` cut or padded (by repeating it from its head) to ``size`` entries."""
    if not order:
        return order
    reps = -(-size // len(order))
    return (order * reps)[:size]


class _CountingIterator:
    """Wraps a DataLoader iterator and tells the sampler how many samples each handed-out batch held."""

    def __init__(self, inner: Iterator[Any], sampler: ResumableDistributedSampler, batch_size: int) -> None:
        self._inner = inner
        self._sampler = sampler
        self._batch_size = batch_size

    def __iter__(self) -> "_CountingIterator":
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._sampler._handed_out(self._batch_size)
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableDistributedSampler` with Lightning's stateful-loader interface.

    ``state_dict()`` is the position in the epoch's global sample order of the samples *handed out* by this
    loader (not the ones its workers prefetched); ``load_state_dict()`` makes the next iteration continue there.
    Lightning calls both on the training loader (the fit loop's checkpoint state, written by rank 0); the state
    is rank-independent. A state from another data set, seed or shuffle setting is refused (ValueError).
    """

    STATE_VERSION = 1

    @property
    def _resumable_sampler(self) -> ResumableDistributedSampler:
        sampler = self.sampler
        if not isinstance(sampler, ResumableDistributedSampler) or self.batch_size is None:
            raise TypeError("ResumableDataLoader needs a ResumableDistributedSampler and a batch_size")
        return sampler

    def __iter__(self) -> Any:
        sampler = self._resumable_sampler
        sampler._new_iteration()
        return _CountingIterator(super().__iter__(), sampler, int(self.batch_size))  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        sampler = self._resumable_sampler
        epoch, seen = sampler.position()
        return {
            "version": self.STATE_VERSION,
            "epoch": int(epoch),
            "samples_seen": int(seen),  # global position in the epoch's order: every rank's samples together
            "dataset_size": len(sampler.dataset),  # type: ignore[arg-type]
            "seed": int(sampler.seed),
            "shuffle": bool(sampler.shuffle),
            "global_batch_size": int(self.batch_size) * sampler.num_replicas,  # type: ignore[arg-type]
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sampler = self._resumable_sampler
        if state_dict.get("version") != self.STATE_VERSION:
            raise ValueError(f"unknown data loader state {state_dict!r}: not written by this version of lightning_moe")
        mine = {"dataset_size": len(sampler.dataset), "seed": int(sampler.seed),  # type: ignore[arg-type]
                "shuffle": bool(sampler.shuffle)}
        differ = {k: (state_dict[k], v) for k, v in mine.items() if state_dict.get(k) != v}
        if differ:
            detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differ.items())
            raise ValueError(
                f"the checkpoint's data position refers to another sample order ({detail}); resume with the data "
                "settings of the checkpointed run (files, seq_len, max_tokens, val_fraction, seed, shuffle)"
            )
        batch = int(self.batch_size) * sampler.num_replicas  # type: ignore[arg-type]
        if state_dict["global_batch_size"] != batch:
            rank_zero_warn(
                f"the checkpointed run read global micro-batches of {state_dict['global_batch_size']} samples, this "
                f"one reads {batch} (batch_size x data-parallel ranks): the data continues at the next sample but "
                "the steps hold other samples than an uninterrupted run's; set `global_batch_size` to keep them"
            )
        epoch, seen = int(state_dict["epoch"]), int(state_dict["samples_seen"])
        left_per_rank = max(0, sampler.total_size - seen) // sampler.num_replicas
        if left_per_rank < (int(self.batch_size) if self.drop_last else 1):  # type: ignore[arg-type]
            epoch, seen = epoch + 1, 0  # the epoch was finished: Lightning starts the next one
        sampler.resume_at(epoch, seen)
