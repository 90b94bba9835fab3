"""Mid-epoch resume: a run interrupted by a checkpoint and resumed with ``fit(ckpt_path=...)`` equals the uninterrupted
run (per-step losses and final parameters, fp32, rel 1e-5), in one process, at W=2 under ep=2, and across a change of
layout at equal global batch (ep=2 on 2 ranks <-> one process).

One piece (about 560 lines): the resume matrix shares one data layout, one training recipe and the uninterrupted
reference runs it compares against.

The data is the embedded corpus packed into 18 samples of 32 tokens, shuffled, 4 samples per optimizer step (one
epoch = 4 steps, 2 samples left over). The runs take 6 steps and are cut after step 3, so the resumed run continues
mid-epoch (step 4 is the last of epoch 0) and then crosses into epoch 1 (a new shuffle). AdamW with warmup + cosine
decay and sigmoid routing with an expert bias: optimizer moments, the LR position and the bias all have to resume.

At an epoch boundary (2 steps an epoch, cut after step 2): a save by ``trainer.save_checkpoint`` after ``fit`` and by
a ``ModelCheckpoint`` in ``on_train_epoch_end`` or on the last batch, with our data module and with a plain
DataLoader, and one saved at W=2 resumed in one process, all continue at batch 0 of epoch 1 like the uninterrupted
run (:mod:`lightning_moe.checkpoint.loop_state`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DistributedSampler

from _dist import run_distributed
from parallel_harness import small_config

from lightning_moe import MoELanguageModel, MoEParallelStrategy
from lightning_moe.data import ResumableDataLoader, ResumableDistributedSampler, TextDataModule

SEQ = 32
NUM_SAMPLES = 18  # training samples; one epoch = NUM_SAMPLES // GLOBAL_BATCH = 4 steps
GLOBAL_BATCH = 4
STEPS = 6
CUT = 3
RTOL = 1e-5
MOE = dict(score_func="sigmoid", expert_bias=True, bias_update_rate=1e-2, aux_loss_type="seq")
# the epoch-boundary runs: 8 samples, 2 steps an epoch, cut after step 2 (the last batch of epoch 0), 5 steps
EPOCH_SAMPLES = 8
EPOCH_CUT = 2
EPOCH_STEPS = 5


# ---------------------------------------------------------------------------- sampler and loader (no Trainer)
class _Range(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(n: int, R: int, r: int, b: int, drop_last: bool = True, shuffle: bool = True) -> ResumableDataLoader:
    sampler = ResumableDistributedSampler(_Range(n), num_replicas=R, rank=r, shuffle=shuffle, seed=3,
                                          drop_last=drop_last)
    return ResumableDataLoader(sampler.dataset, batch_size=b, sampler=sampler, drop_last=drop_last)


def _global_batches(R: int, b: int, n: int = 23, epoch: int = 0) -> list[set[int]]:
    """Micro-batch k of every rank together, for a world of R batch-view ranks."""
    per_rank = []
    for r in range(R):
        dl = _loader(n, R, r, b)
        dl.sampler.set_epoch(epoch)
        per_rank.append([batch.tolist() for batch in dl])
    return [set(sum((p[k] for p in per_rank), [])) for k in range(len(per_rank[0]))]


def test_global_batches_do_not_depend_on_the_layout():
    ref = _global_batches(1, 6)
    assert len(ref) == 3 and all(len(g) == 6 for g in ref)
    assert len(set().union(*ref)) == 18  # no sample twice
    for R, b in ((2, 3), (3, 2), (6, 1)):
        assert _global_batches(R, b) == ref, (R, b)
    assert _global_batches(2, 3, epoch=1) != ref  # set_epoch reshuffles
    # the sampler yields what DistributedSampler yields (Lightning's contract, no resume pending)
    for R, r, drop in ((1, 0, True), (3, 2, True), (4, 1, False)):
        ours = ResumableDistributedSampler(_Range(23), num_replicas=R, rank=r, seed=3, drop_last=drop)
        theirs = DistributedSampler(_Range(23), num_replicas=R, rank=r, seed=3, drop_last=drop)
        for s in (ours, theirs):
            s.set_epoch(2)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("drop_last", [True, False])
def test_loader_state_resumes_at_the_next_sample(drop_last):
    n, R, b = 23, 2, 2
    for epoch in (0, 1):
        full = {r: [] for r in range(R)}
        for r in range(R):
            dl = _loader(n, R, r, b, drop_last)
            dl.sampler.set_epoch(epoch)
            full[r] = [batch.tolist() for batch in dl]
        for cut in range(len(full[0]) + 1):
            dl = _loader(n, R, 0, b, drop_last)
            dl.sampler.set_epoch(epoch)
            it = iter(dl)
            for _ in range(cut):
                next(it)
            state = dl.state_dict()
            assert state["epoch"] == epoch and state["samples_seen"] == min(cut * b, len(dl.sampler)) * R
            for r in range(R):  # rank 0's state restores every rank
                fresh = _loader(n, R, r, b, drop_last)
                fresh.load_state_dict(state)
                if cut < len(full[r]):
                    fresh.sampler.set_epoch(epoch)  # Lightning's call on resume
                    assert [x.tolist() for x in fresh] == full[r][cut:], (epoch, cut, r)
                    assert len(fresh) == len(full[r])  # Lightning counts the epoch's batches from its start
                else:  # the epoch was finished: the state points at the next epoch's start
                    assert fresh.state_dict()["epoch"] == epoch + 1 and fresh.state_dict()["samples_seen"] == 0
            # a second iteration (the next epoch) starts from the beginning again
            fresh = _loader(n, R, 0, b, drop_last)
            fresh.load_state_dict(state)
            fresh.sampler.set_epoch(state["epoch"] if cut < len(full[0]) else epoch + 1)
            list(fresh)
            fresh.sampler.set_epoch(epoch)
            assert [x.tolist() for x in fresh] == full[0]


def test_loader_state_counts_handed_out_batches_not_prefetched_ones():
    sampler = ResumableDistributedSampler(_Range(23), num_replicas=1, rank=0, seed=3)
    dl = ResumableDataLoader(sampler.dataset, batch_size=2, sampler=sampler, drop_last=True, num_workers=1,
                             prefetch_factor=4)
    full = [x.tolist() for x in dl]
    it = iter(dl)
    next(it)
    state = dl.state_dict()  # the worker has fetched several batches ahead by now
    assert state["samples_seen"] == 2
    fresh = _loader(23, 1, 0, 2)
    fresh.load_state_dict(state)
    assert [x.tolist() for x in fresh] == full[1:]
    del it


def test_loader_state_across_layouts_and_bad_states():
    # 2 ranks x 2 samples, cut after 2 micro-batches; resumed by 1 rank x 4 samples: the same remaining global batches
    two = [_loader(22, 2, r, 2) for r in range(2)]
    iters = [iter(dl) for dl in two]
    for it in iters:
        next(it), next(it)
    state = two[0].state_dict()
    assert state["samples_seen"] == 8 and state["global_batch_size"] == 4
    rest_two = [set(a.tolist() + c.tolist()) for a, c in zip(*iters)]
    one = _loader(22, 1, 0, 4)
    one.load_state_dict(state)
    assert [set(x.tolist()) for x in one] == rest_two
    # another global batch still continues at the next sample (with a warning)
    odd = _loader(22, 3, 0, 1)
    with pytest.warns(UserWarning, match="global micro-batches"):
        odd.load_state_dict(state)
    got = set()
    for r in range(3):
        dl = _loader(22, 3, r, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dl.load_state_dict(state)
        got |= {i for x in dl for i in x.tolist()}
    order = ResumableDistributedSampler(_Range(22), num_replicas=1, rank=0, seed=3).global_order()
    assert got == set(order[8:8 + 12])  # 14 left, cut to a multiple of 3 ranks: nothing before position 8
    # a state of another sample order is refused
    for key, value in (("dataset_size", 21), ("seed", 4), ("shuffle", False)):
        with pytest.raises(ValueError, match=key):
            _loader(22, 1, 0, 4).load_state_dict({**state, key: value})


def test_global_batch_size_option(tmp_path):
    from types import SimpleNamespace

    dm = TextDataModule(seq_len=SEQ, max_tokens=NUM_SAMPLES * SEQ + 1, val_fraction=0.2, global_batch_size=4,
                        batch_size=7)
    assert dm.per_rank_batch_size() == 4
    dm.set_batch_view(2, 1)
    assert dm.per_rank_batch_size() == 2 and dm.train_dataloader().batch_size == 2
    assert dm.val_dataloader().batch_size == 2
    assert isinstance(dm.val_dataloader(), ResumableDataLoader)
    dm.trainer = SimpleNamespace(accumulate_grad_batches=2, strategy=SimpleNamespace())
    assert dm.per_rank_batch_size() == 1
    dm.set_batch_view(4, 0)
    with pytest.raises(ValueError, match="global_batch_size=4 does not divide"):
        dm.per_rank_batch_size()
    with pytest.raises(ValueError, match="global_batch_size"):
        TextDataModule(global_batch_size=0)
    assert TextDataModule(batch_size=3).per_rank_batch_size() == 3


# ---------------------------------------------------------------------------- Trainer runs
class Record(Callback):
    """Per optimizer step: the global loss (from the finalised step) and the samples this rank read."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[torch.Tensor] = []
        self.epochs: list[int] = []  # the shuffle epoch of each batch
        self.positions: list[tuple[int, int]] = []  # Lightning's (current_epoch, batch_idx) of each batch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append(batch["input_ids"].detach().cpu().clone())
        self.epochs.append(trainer.train_dataloader.sampler.epoch)
        self.positions.append((trainer.current_epoch, batch_idx))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.losses.append(float(pl_module.step_result.loss))


class _BeforeTheFix(TextDataModule):
    """The loader of the code before this fix: a plain DataLoader over a DistributedSampler (no state)."""

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        s = loader.sampler
        sampler = DistributedSampler(self.train_dataset, num_replicas=s.num_replicas, rank=s.rank, shuffle=s.shuffle,
                                     seed=s.seed, drop_last=s.drop_last)
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=loader.batch_size, sampler=sampler,
                                           drop_last=loader.drop_last)


def _data(cls: type = TextDataModule, num_samples: int = NUM_SAMPLES) -> TextDataModule:
    return cls(seq_len=SEQ, max_tokens=num_samples * SEQ + 1, val_fraction=0.0, shuffle=True, seed=11,
               global_batch_size=GLOBAL_BATCH)


def _fit(strategy: Any, steps: int, ckpt_in: Optional[str] = None, ckpt_out: Optional[str] = None,
         seed: int = 0, data_cls: type = TextDataModule, callbacks: tuple = (),
         num_samples: int = NUM_SAMPLES, precision: str = "32-true", master_dtype: Optional[str] = None) -> dict[str, Any]:
    """One run; ``precision`` and ``master_dtype`` as the Trainer's and MoELanguageModel's. The result holds the final
    full weights (fp32) and, with master weights, the optimizer's full masters by parameter name."""
    torch.manual_seed(seed)  # a resumed run starts from other weights: the checkpoint must overwrite them
    model = MoELanguageModel(small_config(**MOE), lr=3e-3, warmup_steps=2, max_steps=STEPS, min_lr_ratio=0.1,
                             master_dtype=master_dtype)
    rec = Record()
    devices = 1 if strategy == "auto" else torch.distributed.get_world_size()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        precision=precision,
                        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[rec, *callbacks])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=_data(data_cls, num_samples), ckpt_path=ckpt_in)
    if ckpt_out is not None:
        trainer.save_checkpoint(ckpt_out)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model.model, options=StateDictOptions(full_state_dict=True))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().float().clone()
             for k, v in full.items()}
    opt_state = trainer.optimizers[0].state
    with_master = [(n, p, opt_state[p]["master"]) for n, p in model.named_parameters() if "master" in opt_state.get(p, {})]
    masters = {n: _full(m) for n, _, m in with_master}
    # where each master lives: (the parameter's placements, the master's) and whether the local shards agree
    layouts = {n: (_where(p), _where(m), _local(p).shape == _local(m).shape) for n, p, m in with_master}
    return {"losses": rec.losses, "masters": masters, "master_layouts": layouts, "batches": rec.batches, "epochs": rec.epochs,
            "positions": rec.positions, "state": state,
            "global_step": trainer.global_step, "epoch": trainer.current_epoch, "sampler": type(trainer.train_dataloader.sampler).__name__,
            "not_resumable_warning": any("not resumable" in str(w.message) for w in caught)}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _where(t: torch.Tensor) -> str:
    """A DTensor's mesh dimensions and placements ("plain" for a plain tensor)."""
    return f"{t.device_mesh.mesh_dim_names} {t.placements}" if hasattr(t, "placements") else "plain"


def _differences(resumed: dict[str, Any], ref: dict[str, Any], cut: int = CUT, steps: int = STEPS) -> list[str]:
    """Where the resumed part (steps cut+1..steps) and the final parameters differ from the uninterrupted run."""
    problems = []
    if resumed["global_step"] != steps or len(resumed["losses"]) != steps - cut:
        problems.append(f"resumed run took {len(resumed['losses'])} steps, ended at {resumed['global_step']}")
    for i, (a, b) in enumerate(zip(resumed["losses"], ref["losses"][cut:])):
        if abs(a - b) > RTOL * abs(b):
            problems.append(f"step {cut + 1 + i}: loss {a:.8f} vs uninterrupted {b:.8f}")
    for k, v in ref["state"].items():
        err = float((resumed["state"][k] - v).norm() / v.norm().clamp(min=1e-12))
        if err > RTOL:
            problems.append(f"{k}: rel err {err:.2e}")
    return problems


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    """Lightning's single-device strategy: uninterrupted, cut at step 3 (a checkpoint file), resumed; and the
    resume with the code before the fix."""
    tmp = tmp_path_factory.mktemp("one")
    ckpt = str(tmp / "step3.ckpt")
    # the uninterrupted run also writes a checkpoint at step 3 from inside the epoch (ModelCheckpoint)
    every = ModelCheckpoint(dirpath=str(tmp), filename="{step}", every_n_train_steps=CUT, save_top_k=-1)
    out = {"ckpt": ckpt, "ref": _fit("auto", STEPS, callbacks=(every,)), "first": _fit("auto", CUT, ckpt_out=ckpt)}
    out["resumed"] = _fit("auto", STEPS, ckpt_in=ckpt, seed=1)
    out["resumed_callback_ckpt"] = _fit("auto", STEPS, ckpt_in=str(tmp / f"step={CUT}.ckpt"), seed=1)
    # the code before the fix: no loader state in the checkpoint, a loader without state
    old = torch.load(ckpt, weights_only=True)
    del old["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(old, tmp / "step3_old.ckpt")
    out["before_the_fix"] = _fit("auto", STEPS, ckpt_in=str(tmp / "step3_old.ckpt"), seed=1, data_cls=_BeforeTheFix)
    return out


def test_one_process_mid_epoch_resume_is_exact(one_process):
    ref, first, resumed = one_process["ref"], one_process["first"], one_process["resumed"]
    assert ref["sampler"] == "ResumableDistributedSampler"
    # the run crosses an epoch; Lightning's own counter is one ahead after the resume (it counts the epoch that
    # max_steps cut as finished), the data epochs are those of the uninterrupted run
    assert ref["epochs"] == [0, 0, 0, 0, 1, 1] and resumed["epochs"] == [0, 1, 1]
    assert (ref["epoch"], resumed["epoch"]) == (2, 3)
    saved = torch.load(one_process["ckpt"], weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved == [{"version": 1, "epoch": 0, "samples_seen": CUT * GLOBAL_BATCH, "dataset_size": NUM_SAMPLES,
                      "seed": 11, "shuffle": True, "global_batch_size": GLOBAL_BATCH}]
    assert first["losses"] == ref["losses"][:CUT]
    assert not resumed["not_resumable_warning"]
    # the samples: exactly the uninterrupted run's steps 4-6, none repeated, none skipped
    assert len(resumed["batches"]) == STEPS - CUT
    for got, want in zip(resumed["batches"], ref["batches"][CUT:]):
        assert torch.equal(got, want)
    assert not _differences(resumed, ref), "\n".join(_differences(resumed, ref))
    # the losses really move: a resume that read other samples could not pass by accident
    assert len({round(x, 6) for x in ref["losses"]}) == STEPS
    # a checkpoint written by ModelCheckpoint inside the epoch (Lightning's counters say epoch 0, batch 3)
    from_callback = one_process["resumed_callback_ckpt"]
    assert from_callback["epochs"] == [0, 1, 1] and from_callback["epoch"] == 2
    assert not _differences(from_callback, ref), "\n".join(_differences(from_callback, ref))


def test_resume_without_the_data_position_differs(one_process):
    """The control: without a loader position (the code before this fix) Lightning warns and restarts the epoch it
    resumes in from its start; after a max_steps stop that is epoch 1 by its counter, so step 4 reads step 5's
    samples (step 4's are skipped) and steps 5-6 read epoch 2's."""
    ref, bad = one_process["ref"], one_process["before_the_fix"]
    assert bad["not_resumable_warning"]  # Lightning's own warning about such loaders
    assert torch.equal(bad["batches"][0], ref["batches"][CUT + 1])
    problems = _differences(bad, ref)
    assert any(p.startswith("step 4") for p in problems) and any("rel err" in p for p in problems), problems


def _two_ranks(rank: int, world_size: int, tmp: str, one_process_ckpt: str) -> dict[str, Any]:
    out = {"ref": _fit(MoEParallelStrategy(ep=2), STEPS)}
    out["first"] = _fit(MoEParallelStrategy(ep=2), CUT, ckpt_out=f"{tmp}/ep2_step3")
    out["resumed"] = _fit(MoEParallelStrategy(ep=2), STEPS, ckpt_in=f"{tmp}/ep2_step3", seed=1)
    # layout change: the one-process checkpoint (a file) resumed at W=2 under ep=2
    out["from_one_process"] = _fit(MoEParallelStrategy(ep=2), STEPS, ckpt_in=one_process_ckpt, seed=1)
    # saved after fit at the end of an epoch, resumed in one process (test_epoch_end_checkpoint_of_two_ranks_...)
    _fit(MoEParallelStrategy(ep=2), EPOCH_CUT, ckpt_out=f"{tmp}/ep2_epoch_end", num_samples=EPOCH_SAMPLES)
    return out


def _one_rank(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    return _fit(MoEParallelStrategy(), STEPS, ckpt_in=ckpt, seed=1)


@pytest.fixture(scope="module")
def two_ranks(one_process, tmp_path_factory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("ep2"))
    out = run_distributed(_two_ranks, 2, tmp, one_process["ckpt"])
    out["dir"], out["tmp"] = f"{tmp}/ep2_step3", tmp
    return out


@pytest.mark.timeout(300)
def test_ep2_mid_epoch_resume_is_exact(two_ranks):
    ref, first, resumed = two_ranks["ref"], two_ranks["first"], two_ranks["resumed"]
    assert all(b.shape[0] == GLOBAL_BATCH // 2 for b in ref["batches"])  # global_batch_size over 2 data ranks
    assert first["losses"] == pytest.approx(ref["losses"][:CUT], rel=RTOL)
    assert not resumed["not_resumable_warning"]
    for got, want in zip(resumed["batches"], ref["batches"][CUT:]):  # rank 0's samples
        assert torch.equal(got, want)
    assert not _differences(resumed, ref), "\n".join(_differences(resumed, ref))


@pytest.mark.timeout(300)
def test_layout_change_ep2_checkpoint_resumed_in_one_process(two_ranks):
    """Saved under W=2 ep=2 (a distributed checkpoint), resumed by one process at the same global batch."""
    resumed = run_distributed(_one_rank, 1, two_ranks["dir"])
    assert all(b.shape[0] == GLOBAL_BATCH for b in resumed["batches"])
    assert not _differences(resumed, two_ranks["ref"]), "\n".join(_differences(resumed, two_ranks["ref"]))


@pytest.mark.timeout(300)
def test_layout_change_one_process_checkpoint_resumed_under_ep2(two_ranks, one_process):
    """Saved by one process (Lightning's single-device strategy, a file), resumed at W=2 under ep=2."""
    resumed, ref = two_ranks["from_one_process"], one_process["ref"]
    assert all(b.shape[0] == GLOBAL_BATCH // 2 for b in resumed["batches"])
    # rank 0 of 2 reads every other sample of the one-process global batch
    for got, want in zip(resumed["batches"], ref["batches"][CUT:]):
        assert torch.equal(got, want[0::2])
    assert not _differences(resumed, ref), "\n".join(_differences(resumed, ref))


def test_layouts_agree_uninterrupted(two_ranks, one_process):
    """The uninterrupted runs of both layouts agree (the same init, the same global batches): the layout-change
    resumes above are compared with the run of the layout that wrote the checkpoint, and this links the two."""
    problems = _differences({**two_ranks["ref"], "losses": two_ranks["ref"]["losses"][CUT:], "global_step": STEPS},
                            one_process["ref"])
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- resume at an epoch boundary
def _epoch_end_runs(rank: int, world_size: int, tmp: str, ep2_ckpt: str) -> dict[str, Any]:
    """MoEParallelStrategy on one process (the issue's setting): the uninterrupted run with two ModelCheckpoints
    (on the last batch of each epoch, and at each epoch's end), the run cut after step 2 and saved after fit, and
    their resumes; the same cut with a plain DataLoader; the W=2 checkpoint resumed here."""
    def fit(steps: int, **kw: Any) -> dict[str, Any]:
        return _fit(MoEParallelStrategy(), steps, num_samples=EPOCH_SAMPLES, **kw)

    on_batch = ModelCheckpoint(dirpath=f"{tmp}/on_batch", filename="{step}", every_n_train_steps=EPOCH_CUT,
                               save_top_k=-1)
    on_epoch_end = ModelCheckpoint(dirpath=f"{tmp}/on_epoch_end", filename="{step}", every_n_epochs=1, save_top_k=-1)
    out = {"ref": fit(EPOCH_STEPS, callbacks=(on_batch, on_epoch_end)),
           "first": fit(EPOCH_CUT, ckpt_out=f"{tmp}/after_fit")}
    out["after_fit"] = fit(EPOCH_STEPS, ckpt_in=f"{tmp}/after_fit", seed=1)
    out["on_batch"] = fit(EPOCH_STEPS, ckpt_in=f"{tmp}/on_batch/step={EPOCH_CUT}.ckpt", seed=1)
    out["on_epoch_end"] = fit(EPOCH_STEPS, ckpt_in=f"{tmp}/on_epoch_end/step={EPOCH_CUT}.ckpt", seed=1)
    fit(EPOCH_CUT, ckpt_out=f"{tmp}/plain", data_cls=_BeforeTheFix)
    out["plain"] = fit(EPOCH_STEPS, ckpt_in=f"{tmp}/plain", seed=1, data_cls=_BeforeTheFix)
    out["from_two_ranks"] = fit(EPOCH_STEPS, ckpt_in=ep2_ckpt, seed=1)
    return out


@pytest.fixture(scope="module")
def epoch_end(two_ranks, tmp_path_factory) -> dict[str, Any]:
    tmp = str(tmp_path_factory.mktemp("epoch_end"))
    out = run_distributed(_epoch_end_runs, 1, tmp, f"{two_ranks['tmp']}/ep2_epoch_end", timeout=500)
    out["tmp"] = tmp
    return out


def _epoch_end_problems(resumed: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    problems = _differences(resumed, ref, EPOCH_CUT, EPOCH_STEPS)
    if resumed["positions"] != ref["positions"][EPOCH_CUT:]:  # step 3 is batch 0 of epoch 1, not batch 2
        problems.append(f"(epoch, batch_idx) {resumed['positions']} vs uninterrupted {ref['positions'][EPOCH_CUT:]}")
    if not all(torch.equal(a, b) for a, b in zip(resumed["batches"], ref["batches"][EPOCH_CUT:])):
        problems.append("the resumed steps read other samples than the uninterrupted run's")
    return problems


@pytest.mark.timeout(600)
def test_epoch_end_resume_after_fit_is_exact(epoch_end):
    ref = epoch_end["ref"]
    moe = small_config(**MOE).moe
    assert moe.score_func == "sigmoid" and moe.expert_bias and moe.aux_loss_type == "seq" and moe.z_loss_coeff > 0
    assert ref["positions"] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)] and ref["epochs"] == [0, 0, 1, 1, 2]
    assert epoch_end["first"]["losses"] == ref["losses"][:EPOCH_CUT]
    assert len({round(x, 6) for x in ref["losses"]}) == EPOCH_STEPS  # a resume that read other samples shows
    problems = _epoch_end_problems(epoch_end["after_fit"], ref)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_epoch_end_resume_with_a_plain_dataloader_is_exact(epoch_end):
    """No loader state at all (a DataLoader over a DistributedSampler): the epoch boundary is enough."""
    problems = _epoch_end_problems(epoch_end["plain"], epoch_end["ref"])
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["on_batch", "on_epoch_end"])
def test_model_checkpoint_at_the_end_of_an_epoch_resumes_exactly(epoch_end, where):
    """ModelCheckpoint saving on the epoch's last batch (``on_train_batch_end``) and at the epoch's end
    (``on_train_epoch_end``)."""
    problems = _epoch_end_problems(epoch_end[where], epoch_end["ref"])
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_epoch_end_checkpoint_of_two_ranks_resumed_in_one_process(epoch_end):
    """Saved at W=2 (ep=2, a distributed checkpoint) after fit at the end of epoch 0, resumed by one process at the
    same global batch: continues like the one-process uninterrupted run (the layouts agree, see above)."""
    problems = _epoch_end_problems(epoch_end["from_two_ranks"], epoch_end["ref"])
    assert not problems, "\n".join(problems)


def _loops(path: str) -> dict[str, Any]:
    from lightning_moe.checkpoint import META_FILE, resolve

    target = resolve(path)
    ckpt = torch.load(target / META_FILE if target.is_dir() else target, weights_only=True)
    return ckpt


@pytest.mark.timeout(600)
def test_start_next_epoch_on_the_checkpoints_lightning_writes(epoch_end, one_process):
    """The loop-state rewrite reads Lightning's private layout: it must recognise the epoch-end checkpoints that
    Lightning writes (and rewrite them to the next epoch's start) and leave the others alone."""
    from lightning_moe.checkpoint.loop_state import start_next_epoch

    tmp = epoch_end["tmp"]
    for path in (f"{tmp}/after_fit", f"{tmp}/on_epoch_end/step={EPOCH_CUT}.ckpt"):
        ckpt = _loops(path)
        assert start_next_epoch(ckpt), path
        fit = ckpt["loops"]["fit_loop"]
        assert fit["epoch_loop.batch_progress"]["current"] == {"ready": 0, "started": 0, "processed": 0,
                                                               "completed": 0}
        assert fit["epoch_loop.batch_progress"]["total"]["completed"] == EPOCH_CUT
        assert fit["epoch_progress"]["total"] == {"ready": 1, "started": 1, "processed": 1, "completed": 1}
        assert not start_next_epoch(ckpt)  # the rewritten state is an epoch start, nothing more to do
    # mid-epoch (after fit and from ModelCheckpoint) and on the last batch (Lightning's own reset covers it)
    for path in (one_process["ckpt"], f"{tmp}/on_batch/step={EPOCH_CUT}.ckpt"):
        ckpt = _loops(path)
        before = copy.deepcopy(ckpt["loops"])
        assert not start_next_epoch(ckpt) and ckpt["loops"] == before, path
    assert not start_next_epoch({"state_dict": {}})  # weights only


# ---------------------------------------------------------------------------- the resharding matrix at W=4
W4 = dict(tp=2, dp_shard=2, ep=4)  # attention tp=2 x FSDP 2, experts folded over all four ranks


def _four_ranks(rank: int, world_size: int, tmp: str, one_process_ckpt: str) -> dict[str, Any]:
    out = {"ref": _fit(MoEParallelStrategy(**W4), STEPS)}
    out["first"] = _fit(MoEParallelStrategy(**W4), CUT, ckpt_out=f"{tmp}/w4_step3")
    out["resumed"] = _fit(MoEParallelStrategy(**W4), STEPS, ckpt_in=f"{tmp}/w4_step3", seed=1)
    out["from_one_process"] = _fit(MoEParallelStrategy(**W4), STEPS, ckpt_in=one_process_ckpt, seed=1)
    return out


def _two_ranks_tp(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    return _fit(MoEParallelStrategy(tp=2, dp_shard=1), STEPS, ckpt_in=ckpt, seed=1)


def _two_ranks_ep(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    return _fit(MoEParallelStrategy(ep=2), STEPS, ckpt_in=ckpt, seed=1)


@pytest.mark.timeout(600)
def test_resharding_matrix_at_four_ranks(one_process, tmp_path_factory):
    """Saved at W=4 (tp=2 x dp_shard=2, ep=4): resumed at the same layout, at W=2 ep=2, at W=2 tp=2 and on one device; saved on
    one device and resumed at W=4. Every resume continues like the uninterrupted run (the same global batch)."""
    tmp = str(tmp_path_factory.mktemp("w4"))
    out = run_distributed(_four_ranks, 4, tmp, one_process["ckpt"], timeout=500)
    ref = out["ref"]
    failures = [f"[W4 uninterrupted vs one process] {p}" for p in _differences(
        {**ref, "losses": ref["losses"][CUT:], "global_step": STEPS}, one_process["ref"])]
    failures += [f"[W4 -> W4] {p}" for p in _differences(out["resumed"], ref)]
    failures += [f"[1 -> W4] {p}" for p in _differences(out["from_one_process"], one_process["ref"])]
    failures += [f"[W4 -> W2 tp=2] {p}" for p in _differences(run_distributed(_two_ranks_tp, 2, f"{tmp}/w4_step3"), ref)]
    failures += [f"[W4 -> W2 ep=2] {p}" for p in _differences(run_distributed(_two_ranks_ep, 2, f"{tmp}/w4_step3"), ref)]
    failures += [f"[W4 -> 1] {p}" for p in _differences(run_distributed(_one_rank, 1, f"{tmp}/w4_step3"), ref)]
    assert not failures, "\n".join(failures[:20])


def _two_ranks_cp_etp(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    return {"cp=2": _fit(MoEParallelStrategy(cp=2, dp_shard=1), STEPS, ckpt_in=ckpt, seed=1),
            "etp=2 (experts split over F)": _fit(MoEParallelStrategy(etp=2), STEPS, ckpt_in=ckpt, seed=1),
            "HSDP dp_replicate=2": _fit(MoEParallelStrategy(dp_replicate=2, dp_shard=1), STEPS, ckpt_in=ckpt, seed=1)}


@pytest.mark.timeout(600)
def test_one_process_checkpoint_resumed_under_cp_etp_and_hsdp(one_process):
    """The one-process checkpoint resumed under context parallelism, expert tensor parallelism and HSDP replicas
    continues like the uninterrupted run."""
    out = run_distributed(_two_ranks_cp_etp, 2, one_process["ckpt"])
    failures = [f"[{name}] {p}" for name, res in out.items() for p in _differences(res, one_process["ref"])]
    assert not failures, "\n".join(failures[:20])
