"""Writer side of tests/test_checkpoint_kill.py: saves killed at every filesystem step, in turn.

``python tests/_kill_save.py OUT`` imports torch and Lightning once and then forks one child per run (two at a
time: they are independent), before any process group exists (a forked gloo group has lost its worker threads).
Each child initialises its own one-rank group, trains the tiny model and saves through ``MoEParallelStrategy``:

* a template child per scenario writes the previous checkpoint (after step 1) into ``OUT/SCENARIO/template``;
  the sync one also records the full weights after steps 1 and 2 and the losses of steps 1-3;
* kill child n starts from a copy of the template in ``OUT/SCENARIO/n``, saves after step 2 over the template's
  checkpoint and SIGKILLs itself just before its n-th filesystem step (``os.mkdir``, ``rename``, ``replace``,
  ``symlink``, ``unlink``, ``rmdir``, ``fsync`` ..., on any thread) counted from the start of that save; n = 1, 2,
  ... until a child completes.

Scenarios: ``sync`` and ``async`` (``async_save=True``: written in the background, published at the end of fit) over
a versioned directory, ``legacy`` (sync, over a plain directory as written before versions existed) and ``file``
(``save_distributed_checkpoint=False``: one file with its CRC sidecar). ``OUT/manifest.json`` lists the runs.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  (imported before the forks: children start warm)
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from parallel_harness import GLOBAL_BATCH, FixedData, small_config

from lightning_moe import MoELanguageModel, MoEParallelStrategy

NAME = "ckpt"  # the checkpoint's path in each run's folder
SCENARIOS = {"sync": {}, "async": {"async_save": True}, "legacy": {},
             "file": {"save_distributed_checkpoint": False}}
FS_STEPS = ("mkdir", "rename", "replace", "symlink", "unlink", "remove", "rmdir", "fsync")
MAX_STEPS = 200  # a save with more steps than this is a bug of its own
# children at once: the kill runs are independent (a folder each); one thread each
PARALLEL = max(1, min(2, os.cpu_count() or 1))


def arm_kill(n: int) -> None:
    """SIGKILL this process just before its n-th filesystem step from now on (any thread)."""
    lock, count = threading.Lock(), [0]
    for name in FS_STEPS:
        real = getattr(os, name)

        def step(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            with lock:
                count[0] += 1
                if count[0] == n:
                    os.kill(os.getpid(), signal.SIGKILL)
            return _real(*args, **kwargs)

        setattr(os, name, step)


def _full_state(module: Any) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


class _Run(Callback):
    def __init__(self, save_at: int, path: Path, kill_at: Optional[int], record: Optional[Path]) -> None:
        self.save_at, self.path, self.kill_at, self.record = save_at, path, kill_at, record
        self.losses: list[float] = []
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.losses.append(float(pl_module.step_result.loss))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.record is not None and trainer.global_step <= 2:
            self.states[trainer.global_step] = _full_state(pl_module)
        if trainer.global_step == self.save_at:
            if self.kill_at is not None:
                arm_kill(self.kill_at)
            trainer.save_checkpoint(self.path)  # an async save is published at the end of fit


def _child(scenario: str, folder: Path, save_at: int, steps: int, kill_at: Optional[int],
           record: Optional[Path]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}.store", rank=0, world_size=1)
    torch.manual_seed(0)
    model = MoELanguageModel(small_config(), lr=1e-2, warmup_steps=1, max_steps=4)
    run = _Run(save_at, folder / NAME, kill_at, record)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEParallelStrategy(**SCENARIOS[scenario]),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        use_distributed_sampler=False, callbacks=[run])
    # one batch an epoch, the same every epoch: a resume anywhere reads what the uninterrupted run read
    trainer.fit(model, datamodule=FixedData(GLOBAL_BATCH, GLOBAL_BATCH))
    if record is not None:
        torch.save({"losses": run.losses, "states": run.states}, record)


def _start(*args: Any) -> int:
    """Fork a child running _child(*args); its pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _child(*args)
        except BaseException:
            Path(f"{args[1]}.err").write_text(traceback.format_exc())
            code = 1
        os._exit(code)
    return pid


def _outcome(status: int, args: tuple) -> str:
    """"done", "killed" or raise with the child's traceback."""
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "done"
    err = Path(f"{args[1]}.err")
    raise RuntimeError(f"child {args} failed ({status}):\n{err.read_text() if err.exists() else ''}")


def _run_all(jobs: Any, parallel: int) -> None:
    """Run the children ``jobs()`` hands out, ``parallel`` at a time; ``jobs()`` returns (args, callback) or None
    (nothing to start now), and each callback gets its child's outcome."""
    running: dict[int, tuple] = {}
    while True:
        while len(running) < parallel and (job := jobs()) is not None:
            running[_start(*job[0])] = job
        if not running:
            return
        pid, status = os.waitpid(-1, 0)
        args, callback = running.pop(pid)
        callback(_outcome(status, args))


def _to_legacy(template: Path) -> None:
    """The template's checkpoint as a plain directory at its path, as saves wrote it before versions existed."""
    version = (template / NAME).resolve()
    (template / NAME).unlink()
    shutil.copytree(version, template / NAME)
    shutil.rmtree(version.parent)


def main(out: Path) -> None:
    """Every scenario's template, then its kill children n = 1, 2, ... until one completes; the children run
    ``PARALLEL`` at a time (each on one thread), several scenarios and several n at once."""
    manifest: dict[str, Any] = {"record": str(out / "record.pt"), "scenarios": {}}
    outcomes: dict[str, dict[int, str]] = {s: {} for s in SCENARIOS}
    state = {s: "template" for s in SCENARIOS}  # -> "template running" -> "kills" -> "finished"
    next_n = dict.fromkeys(SCENARIOS, 1)

    def template_done(scenario: str, outcome: str) -> None:
        assert outcome == "done", scenario
        if scenario == "legacy":
            _to_legacy(out / scenario / "template")
        state[scenario] = "kills"

    def kill_done(scenario: str, n: int, outcome: str) -> None:
        outcomes[scenario][n] = outcome
        first_done = min((k for k, o in outcomes[scenario].items() if o == "done"), default=None)
        # done once every n up to the first completed save has its outcome (the first complete save ends the list)
        if first_done is not None and all(k in outcomes[scenario] for k in range(1, first_done)):
            state[scenario] = "finished"

    def jobs() -> Any:
        for scenario in SCENARIOS:
            base = out / scenario
            if state[scenario] == "template":
                state[scenario] = "template running"
                (base / "template").mkdir(parents=True)
                record = out / "record.pt" if scenario == "sync" else None
                return (scenario, base / "template", 1, 3, None, record), functools.partial(template_done, scenario)
            if state[scenario] == "kills" and not any(o == "done" for o in outcomes[scenario].values()):
                n = next_n[scenario]
                if n > MAX_STEPS:
                    raise RuntimeError(f"{scenario}: the save still had filesystem steps left after {MAX_STEPS}")
                next_n[scenario] = n + 1
                folder = base / str(n)
                shutil.copytree(base / "template", folder, symlinks=True)
                return (scenario, folder, 2, 2, n, None), functools.partial(kill_done, scenario, n)
        return None

    _run_all(jobs, PARALLEL)
    for scenario in SCENARIOS:
        assert state[scenario] == "finished", (scenario, state[scenario], outcomes[scenario])
        first_done = min(k for k, o in outcomes[scenario].items() if o == "done")
        runs = [{"n": n, "path": str(out / scenario / str(n) / NAME), "outcome": outcomes[scenario][n]}
                for n in range(1, first_done + 1)]
        manifest["scenarios"][scenario] = {"template": str(out / scenario / "template" / NAME), "runs": runs}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
