"""The convergence mode of ``bench/low_precision.py`` (its docstring has the protocol): the settings of the two
presets, the runs per (recipe, init seed) that earlier reports lack, and their paired comparison."""

from __future__ import annotations

import argparse
import datetime
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch

from bench import train_step
from bench.core.curves import (BASE, NOISE, REPEAT, compare, convergence_table, paired_stats, reference_runs, run_arm,
                               run_key, run_label, save_curves, tightest_target)
from bench.core.text import log
from bench.lowp_time_shares import expected_outside_s, first_margin_s, first_step_s, time_shares
from lightning_moe.callbacks.low_precision import BLOCK_RECIPES
from lightning_moe.lowp.high_precision import high_precision

TARGETS = {"fp8": 0.01, "block": 0.03}  # |relative difference| of the smoothed final loss
# bench8: at 3e-4 (and bf16 AdamW state) two runs of the same bf16 program ended 5.6% apart (RESULTS.md)
BENCH8_LR = 1e-4
TINY_YAML = Path(__file__).resolve().parent.parent / "examples" / "configs" / "tiny.yaml"


class HighPrecisionLoss(L.Callback):
    """``--conv-hp-loss``: before every training step, the loss of the same batch at the same weights with every
    low-precision module in its high-precision path (:func:`lightning_moe.lowp.high_precision.high_precision`), no
    gradient. Against the step's own loss it is what the quantized forward costs at fixed weights; against the bf16
    run's loss, what the low-precision training did to the weights. ``seconds``: the time these forwards took (inside
    the step times the report prints)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.seconds = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        t0 = time.perf_counter()
        with torch.no_grad(), high_precision(pl_module), trainer.precision_plugin.forward_context():
            out = pl_module._step_output(batch)  # the training step's own loss computation, nothing recorded
            self.losses.append(float(out.loss_sum / out.num_tokens))
        self.seconds += time.perf_counter() - t0


def _plain_name(name: str) -> str:
    """A parameter's name in the model (no LightningModule prefix ``model.``, no checkpoint-wrapper part)."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    return name[len("model."):] if name.startswith("model.") else name


def grad_group(name: str) -> str:
    """A parameter's group in the gradient check: its role, over all layers (``attention.wq``, ``experts.w2``,
    ``router``, ``norms``, ``embedding``, ``head``)."""
    name = _plain_name(name)
    parts = name.split(".")
    if parts[0] == "tok_embeddings":
        return "embedding"
    if parts[0] == "output":
        return "head"
    if "norm" in name:
        return "norms"
    if "router" in parts:
        return "router"
    for role in ("experts", "shared_experts", "attention", "feed_forward"):
        if role in parts:
            leaf = parts[parts.index(role) + 1]
            return f"{role}.{leaf}"
    return parts[-2] if len(parts) > 1 else name


class GradientCheck(L.Callback):
    """``--conv-grad-check``: at the given steps, the step's own (low-precision) gradient against the high-precision
    gradient of the same batch at the same weights (:func:`~lightning_moe.lowp.high_precision.high_precision`), per
    parameter group (:func:`grad_group`), before clipping: ``rel_err`` = |q - h| / |h|, ``cos``, ``proj`` = <q, h> /
    |h|^2 (1: no shrinking or growth along the true gradient). Over each window of ``window`` consecutive steps,
    for the groups in ``persist`` (accumulators the size of those parameters) the persistence of the error,
    ``err_persist`` = |sum of e| / sqrt(sum of |e|^2): about 1 when the errors of successive steps are independent,
    up to sqrt(window) when each step makes the same error (a bias, which the optimizer's averaging cannot remove);
    ``grad_persist`` the same ratio of the high-precision gradients (how much of the signal itself persists); and
    ``mean_rel_err`` = |mean e| / |mean h|, the error of the window's mean gradient. The same statistics in AdamW's
    coordinates, where its update lives (each element over the run's own second-moment denominator of that step,
    sqrt(v_hat) + eps with v fed this step's q; clipping, a factor common to all, left out): ``adam_rel_err``,
    ``adam_cos`` per step and ``adam_mean_rel_err`` per window. Adam gives an element with a small gradient rms
    the same step size as a large one, so an error that sits on small elements shows here far above ``rel_err``;
    parameters the optimizer has no second moment for are left out of them. The extra forward and backward change
    nothing in the run (the step's gradients and the optimizer's state are read, not written)."""

    def __init__(self, starts: list[int], window: int = 8,
                 persist: tuple[str, ...] = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "router",
                                             "norms", "experts.w1", "experts.w2", "experts.w3")) -> None:
        if window < 1 or any(s < 1 for s in starts):
            raise ValueError(f"--conv-grad-check: steps start at 1 and windows hold >= 1 step, got {starts}, {window}")
        ordered = sorted(set(starts))
        if any(b - a < window for a, b in zip(ordered, ordered[1:])):
            raise ValueError(f"--conv-grad-check {','.join(map(str, ordered))}: windows of {window} steps overlap; "
                             "start them at least --conv-grad-window steps apart")
        self.window, self.persist = window, persist
        self.checked = sorted({s + i for s in starts for i in range(window)})
        self.windows = sorted(set(starts))
        self.steps: list[dict[str, Any]] = []  # one per checked step: {"step", "groups": {group: stats}}
        self.window_stats: list[dict[str, Any]] = []
        self.seconds = 0.0
        self._batch: Any = None
        # name -> [sum e, sum h, sum |e|^2, sum |h|^2, sum e/d, sum h/d] (d: AdamW's denominator; None without one)
        self._acc: dict[str, list[Any]] = {}
        self._window: Any = None
        self._layers: set[int] = set()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.accumulate_grad_batches != 1:  # a step's gradient would be several batches', the check one's
            raise ValueError("--conv-grad-check compares one batch's gradients: it needs accumulate_grad_batches=1, "
                             f"got {trainer.accumulate_grad_batches}")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step + 1
        self._batch = batch if step in self.checked else None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._batch is None:
            return
        t0 = time.perf_counter()
        step, batch, self._batch = trainer.global_step + 1, self._batch, None
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad and p.grad is not None]
        self._layers = {int(parts[1]) for parts in (_plain_name(n).split(".") for n, _ in named)
                        if parts[0] == "layers" and parts[1].isdigit()}
        with torch.enable_grad(), high_precision(pl_module), trainer.precision_plugin.forward_context():
            out = pl_module._step_output(batch)  # the training step's objective, in high precision
            n = out.num_tokens.to(out.loss_sum.dtype).clamp(min=1)
            objective = (out.loss_sum + n * (out.aux_loss + out.z_loss)) / n
        hp = torch.autograd.grad(objective, [p for _, p in named], allow_unused=True)
        hyper = {id(p): (g["betas"][1], g["eps"]) for g in optimizer.param_groups
                 if "betas" in g and "eps" in g for p in g["params"]}
        start = max((s for s in self.windows if s <= step < s + self.window), default=None)
        if start != self._window:
            self._close_window()
            self._window = start
        groups: dict[str, torch.Tensor] = {}
        adam_groups: dict[str, torch.Tensor] = {}  # the same sums in AdamW's coordinates (each element over d)
        for (name, p), h in zip(named, hp):
            if h is None:
                continue
            q, h = p.grad.detach().float(), h.detach().float()
            e = q - h
            g = grad_group(name)
            d = adam_denominator(q, optimizer.state.get(p, {}), *hyper.get(id(p), (None, None)))
            ea, ha = (e / d, h / d) if d is not None else (None, None)
            stats = torch.stack([(q * q).sum(), (h * h).sum(), (q * h).sum(), (e * e).sum()])
            groups[g] = groups[g] + stats if g in groups else stats
            if ea is not None:
                qa = ea + ha
                stats_a = torch.stack([(qa * qa).sum(), (ha * ha).sum(), (qa * ha).sum(), (ea * ea).sum()])
                adam_groups[g] = adam_groups[g] + stats_a if g in adam_groups else stats_a
            if g in self.persist and self._persists(name, p):
                acc = self._acc.get(name)
                if acc is None:  # large tensors (the experts) accumulate in bf16: a norm ratio needs no more
                    dtype = torch.bfloat16 if e.numel() > 2**25 else torch.float32
                    self._acc[name] = [e.to(dtype), h.to(dtype), float(stats[3]), float(stats[1]),
                                       *((ea.to(dtype), ha.to(dtype)) if ea is not None else (None, None))]
                else:
                    acc[0] += e
                    acc[1] += h
                    acc[2] += float(stats[3])
                    acc[3] += float(stats[1])
                    if ea is not None and acc[4] is not None:
                        acc[4] += ea
                        acc[5] += ha
                    else:  # a step without the optimizer's moments: the window has no AdamW figure
                        acc[4] = acc[5] = None
        rows = {}
        for g, (qq, hh, qh, ee) in ((g, v.tolist()) for g, v in sorted(groups.items())):
            rows[g] = {"rel_err": math.sqrt(ee / hh) if hh > 0 else None,
                       "cos": qh / math.sqrt(qq * hh) if qq > 0 and hh > 0 else None,
                       "proj": qh / hh if hh > 0 else None}
            if g in adam_groups:
                qq, hh, qh, ee = adam_groups[g].tolist()
                rows[g]["adam_rel_err"] = math.sqrt(ee / hh) if hh > 0 else None
                rows[g]["adam_cos"] = qh / math.sqrt(qq * hh) if qq > 0 and hh > 0 else None
        self.steps.append({"step": step, "groups": rows})
        if step == max(self.checked):
            self._close_window()
        self.seconds += time.perf_counter() - t0

    def _persists(self, name: str, p: torch.Tensor) -> bool:
        """Whether ``name`` gets window accumulators: every parameter of under 2^25 elements, the larger ones (the
        experts) in the first and the last layer only (two accumulators of the parameter's size each: fp32, bf16 for the
        large ones)."""
        if p.numel() <= 2**25:
            return True
        parts = _plain_name(name).split(".")
        if parts[0] != "layers" or not parts[1].isdigit():
            return False
        return int(parts[1]) in (min(self._layers), max(self._layers))

    def _close_window(self) -> None:
        if not self._acc:
            return
        by_group: dict[str, list[Any]] = {}
        for name, (se, sh, ee, hh, sea, sha) in self._acc.items():
            v = by_group.setdefault(grad_group(name), [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            v[0] += float((se * se).sum())
            v[1] += float((sh * sh).sum())
            v[2] += ee
            v[3] += hh
            if sea is None or v[4] is None:  # one parameter of the group without AdamW moments: no group figure
                v[4] = v[5] = None
            else:
                v[4] += float(sea.float().square().sum())
                v[5] += float(sha.float().square().sum())
        steps = [s["step"] for s in self.steps if self._window is not None
                 and self._window <= s["step"] < self._window + self.window]
        self.window_stats.append({"start": self._window, "steps": len(steps), "groups": {
            g: {"err_persist": math.sqrt(se / ee) if ee > 0 else None,
                "grad_persist": math.sqrt(sh / hh) if hh > 0 else None,
                "mean_rel_err": math.sqrt(se / sh) if sh > 0 else None,
                "adam_mean_rel_err": math.sqrt(sea / sha) if sea is not None and sha > 0 else None}
            for g, (se, sh, ee, hh, sea, sha) in sorted(by_group.items())}})
        self._acc = {}

    def summary(self) -> dict[str, Any]:
        """Per group: the mean over the checked steps of each step statistic; the windows as they are (one the run
        ended in, before its last step, closed with the steps it has)."""
        self._close_window()
        groups: dict[str, dict[str, list[float]]] = {}
        for s in self.steps:
            for g, row in s["groups"].items():
                for k, v in row.items():
                    if v is not None:
                        groups.setdefault(g, {}).setdefault(k, []).append(v)
        return {"checked_steps": len(self.steps), "seconds": self.seconds, "steps": self.steps,
                "windows": self.window_stats,
                "mean": {g: {k: sum(v) / len(v) for k, v in row.items()} for g, row in sorted(groups.items())}}


def adam_denominator(q: torch.Tensor, state: dict[str, Any], beta2: float | None,
                     eps: float | None) -> torch.Tensor | None:
    """AdamW's denominator of this step for gradient ``q`` (float): sqrt(v_hat) + eps, v = beta2 * v_prev + (1 -
    beta2) * q^2 from the optimizer's ``exp_avg_sq`` (absent before its first step: zero), bias-corrected by the step
    about to be taken; None without Adam hyperparameters or when the moment is not a plain tensor of q's shape."""
    if beta2 is None or eps is None:
        return None
    v_prev, t_prev = state.get("exp_avg_sq"), state.get("step", 0)
    if v_prev is not None and (type(v_prev) is not torch.Tensor or v_prev.shape != q.shape):
        return None  # e.g. a DTensor shard's moment: not this check's (one-process) business
    t = float(t_prev) + 1.0
    v = (1.0 - beta2) * q * q
    if v_prev is not None:
        v = v + beta2 * v_prev.float()
    return (v / (1.0 - beta2 ** t)).sqrt_() + eps


def grad_check_table(label: str, check: dict[str, Any]) -> str:
    """The gradient check of one run as text: per group the mean step statistics, then each window's."""
    lines = [f"gradient check, {label}: {check['checked_steps']} steps ({check['seconds']:.1f} s); "
             "step means of rel_err |q-h|/|h|, cos, proj <q,h>/|h|^2; per window err_persist (1: independent "
             "errors, sqrt(n): the same error every step), grad_persist (the same of h), mean_rel_err"]
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    lines.append(f"  {'group':<22} {'rel_err':>8} {'cos':>7} {'proj':>7} {'adam_rel_err':>12} {'adam_cos':>8}")
    for g, row in check["mean"].items():
        lines.append(f"  {g:<22} {fmt(row.get('rel_err')):>8} {fmt(row.get('cos')):>7} {fmt(row.get('proj')):>7} "
                     f"{fmt(row.get('adam_rel_err')):>12} {fmt(row.get('adam_cos')):>8}")
    for w in check["windows"]:
        lines.append(f"  window from step {w['start']} ({w['steps']} steps, sqrt = {math.sqrt(max(w['steps'], 1)):.2f})"
                     f": {'group':<16} {'err_persist':>11} {'grad_persist':>12} {'mean_rel_err':>12} "
                     f"{'adam_mean_rel_err':>17}")
        for g, row in w["groups"].items():
            lines.append(f"    {g:<22} {fmt(row['err_persist']):>11} {fmt(row['grad_persist']):>12} "
                         f"{fmt(row['mean_rel_err']):>12} {fmt(row.get('adam_mean_rel_err')):>17}")
    return "\n".join(lines)


def parse_model_overrides(items: list[str]) -> dict[str, Any]:
    """``--conv-model`` items ``KEY=VALUE`` (``moe.KEY`` for the MoE block; VALUE a JSON or YAML scalar) as keyword overrides
    of :meth:`ModelConfig.from_preset`, e.g. ``["hidden_size=512", "moe.num_experts=128"]`` ->
    ``{"hidden_size": 512, "moe": {"num_experts": 128}}``."""
    import json

    import yaml

    def scalar(text: str) -> Any:
        try:
            return json.loads(text)  # 1e4 is a float here, a string to YAML 1.1
        except ValueError:
            return yaml.safe_load(text)

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SystemExit(f"--conv-model {item!r}: write KEY=VALUE, e.g. hidden_size=512 or moe.num_experts=64")
        *parents, leaf = key.split(".")
        if len(parents) > 1 or (parents and parents[0] != "moe"):
            raise SystemExit(f"--conv-model {item!r}: only model fields and moe.<field> can be set")
        node = out.setdefault("moe", {}) if parents else out
        node[leaf] = scalar(value)
    return out


def bench8_config(args: argparse.Namespace) -> Any:
    """The 8-layer Qwen3-30B-A3B-shaped bench model of ``bench/train_step.py`` (2 small layers with ``--small``),
    with ``--conv-model`` overrides (a shape between the two, to find where FP8's loss difference appears)."""
    cfg = train_step.qwen_config(argparse.Namespace(small=args.small, layers=2 if args.small else 8,
                                                    seq_len=args.seq_len))
    overrides = parse_model_overrides(getattr(args, "conv_model", None) or [])
    if not overrides:
        return cfg
    base = cfg.to_dict()
    moe = {**base.pop("moe"), **overrides.pop("moe", {})}
    try:
        return type(cfg).from_dict({**base, **overrides, "moe": moe})
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--conv-model: {e}") from e


def _tiny_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The main job's model, data and optimisation settings (examples/configs/tiny.yaml)."""
    import yaml

    from lightning_moe.config import ModelConfig

    spec = yaml.safe_load(TINY_YAML.read_text())
    model, data, trainer = spec["model"], spec["data"], spec["trainer"]
    return {"cfg": ModelConfig.from_preset(model["config"]), "lr": float(model["lr"]),
            "seq_len": 64 if args.small else int(data["seq_len"]),
            "batch_size": 2 if args.small else int(data["batch_size"]),
            "module": {"min_lr_ratio": float(model["min_lr_ratio"]), "weight_decay": float(model["weight_decay"])},
            "data": {"val_fraction": float(data["val_fraction"]), "seed": int(data["seed"])},
            "clip": float(trainer["gradient_clip_val"]), "source": str(TINY_YAML.relative_to(TINY_YAML.parents[2]))}


def _bench8_settings(args: argparse.Namespace) -> dict[str, Any]:
    s = {"cfg": bench8_config(args), "lr": BENCH8_LR, "seq_len": args.seq_len, "batch_size": args.batch_size,
         "module": {"min_lr_ratio": 0.1, "weight_decay": 0.1}, "data": {}, "clip": 1.0,
         # the toy shape named, so its reports never merge with (or pool as) the full model's at equal settings
         "source": "bench/train_step.py qwen_config (" + ("--small: 2 layers, D 256, 8 experts top-2)" if args.small
                                                          else "8 layers)")}
    if getattr(args, "conv_model", None):  # recorded, so reports of other shapes never merge (--conv-reference)
        s["model_overrides"] = list(args.conv_model)
        s["source"] += " with --conv-model overrides"
    return s


def convergence_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The preset's model, data and optimisation settings with ``--conv-lr`` / ``--conv-warmup`` /
    ``--conv-master`` applied: ``lr``, ``warmup`` (steps) and ``master`` ("fp32" or "none") always set."""
    s = _tiny_settings(args) if args.preset == "tiny" else _bench8_settings(args)
    steps = args.conv_steps
    if args.conv_lr is not None:
        s["lr"] = args.conv_lr
    # the main job's warmup for tiny; bench8 a tenth of the run (a 20-step ramp to 3e-4 spiked its bf16 baseline)
    s["warmup"] = args.conv_warmup if args.conv_warmup is not None else max(
        1, steps // 10 if args.preset == "bench8" else min(20, steps // 10))
    s["master"] = args.conv_master if args.conv_master != "auto" else (
        "fp32" if args.preset == "bench8" and args.precision.startswith("bf16") else "none")
    return s


def bench_convergence(args: argparse.Namespace, device: torch.device, budget: Any, run: Callable[..., dict[str, Any]],
                      unit_s: float, checkpoint: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """The convergence mode of ``bench/low_precision.py``: ``run`` trains one recipe from one init (its ``_run``),
    ``budget`` (its ``Budget``) bounds the call, a run starts only with ``unit_s`` seconds left. ``checkpoint``
    receives the report so far (``partial``: the references and the runs finished until then) after every run, so
    that a call killed from outside still leaves what it finished (readable with ``--conv-reference``)."""
    s = convergence_settings(args)
    steps, warmup = args.conv_steps, s["warmup"]
    variant = "auto+master" if s["master"] == "fp32" else ""
    report: dict[str, Any] = {"preset": args.preset, "settings": {k: v for k, v in s.items() if k != "cfg"},
                              "warmup_steps": warmup, "steps": steps, "smooth": args.smooth, "runs": [], "summary": []}
    report["settings"]["precision"] = args.precision
    # (arm, seed): per init seed the baseline and each recipe from that init (a paired comparison), then
    # (--noise-seed) the baseline from another init, whose difference to the first is the noise
    seeds = args.conv_seeds or (args.seed,)
    wanted = [(arm, sd) for sd in seeds for arm in (BASE, *args.recipes)]
    if args.noise_seed is not None and (BASE, args.noise_seed) not in wanted:
        wanted.append((BASE, args.noise_seed))
    refs = reference_runs([Path(p) for p in args.conv_reference], report) if args.conv_reference else []
    have = {run_key(r) for r in refs}
    todo = [w for w in wanted if w not in have]  # what earlier reports (--conv-reference) did not run
    # a run's share of what is left goes by its expected cost (time_shares): measured once runs of its kind finish
    new: list[dict[str, Any]] = []
    margin = first_margin_s(args.preset, args.small, device.type)
    first_s = first_step_s(args.preset, args.small, device.type)
    for i, (arm, seed) in enumerate(todo):
        label = run_label(arm, seed, args.seed)
        left = budget.left()
        later = [a for a, _ in todo[i:]]
        # in order: each run may use all that is left (runs complete in order; the target counts complete pairs
        # only); proportional: by expected cost, so that every run gets some steps when not all can finish
        share = time_shares(left, later, steps, new, margin, first_s) \
            if math.isfinite(left) and args.conv_share == "proportional" else left
        outside = expected_outside_s(arm, new, margin)
        if i == 0 and math.isfinite(left) and left < len(later) * outside:
            log(f"convergence {args.preset}: {left:.0f} s for {len(later)} runs that each spend about "
                f"{outside:.0f} s outside their steps: the later runs will get a step or none (raise --time-limit "
                "or ask for fewer seeds or recipes)")
        if not budget.allows(unit_s, f"convergence {args.preset} {label}"):
            new.append({"model": f"{args.preset}-{label}", "recipe": label, "arm": arm, "seed": seed,
                        "skipped": "time limit", "losses": []})
            continue
        trainer_kwargs: dict[str, Any] = {"gradient_clip_val": s["clip"]}
        if math.isfinite(share):
            train_s = max(1.0, share - outside)
            trainer_kwargs["max_time"] = datetime.timedelta(seconds=train_s)
            log(f"convergence {args.preset} {label}: up to {train_s:.0f} s of training (--time-limit share)")
        hp = HighPrecisionLoss() if args.conv_hp_loss and arm not in (BASE, REPEAT, NOISE) else None
        checker = GradientCheck(args.conv_grad_check, args.conv_grad_window) \
            if args.conv_grad_check and arm != BASE else None
        more = tuple(c for c in (hp, checker) if c is not None)
        r = run(args.preset, s["cfg"], arm, args, device, None, False, steps, s["seq_len"], s["batch_size"],
                 s["lr"], seed=seed, module_kwargs={"warmup_steps": warmup, **s["module"]}, variant=variant,
                 trainer_kwargs=trainer_kwargs, data_kwargs=s["data"], more_callbacks=more)
        if hp is not None:
            r["hp_losses"], r["hp_seconds"] = hp.losses[:len(r["losses"])], hp.seconds
        if checker is not None:
            r["grad_check"] = checker.summary()
            log(grad_check_table(label, r["grad_check"]))
        r["recipe"], r["arm"] = label, arm
        r["truncated"] = len(r["losses"]) < steps
        if r["truncated"]:
            log(f"convergence {args.preset} {label}: stopped after {len(r['losses'])} of {steps} steps "
                f"({'error' if 'error' in r else 'time limit'})")
        new.append(r)
        if checkpoint is not None:
            checkpoint({**report, "runs": [*refs, *new], "partial": True})
    # --seed's baseline first (what the table and the plot compare the other inits with), then the runs in the order
    # asked, each seed's baseline before its recipes, then the references' other runs
    order = {w: k for k, w in enumerate(wanted)}
    report["runs"] = sorted([*refs, *new], key=lambda r: (run_key(r) != (BASE, args.seed),
                                                           order.get(run_key(r), len(order)),
                                                           run_key(r)[1] != args.seed, run_arm(r) != BASE))
    for r in report["runs"]:
        r["recipe"] = run_label(*run_key(r), args.seed)
    bases = {run_key(r)[1]: r for r in report["runs"] if run_arm(r) == BASE}
    base = bases.get(args.seed, report["runs"][0])
    for r in report["runs"]:
        if r is base:
            continue
        arm, seed = run_key(r)
        noise = arm == BASE  # another init: its difference is the noise, no target
        target = None if noise or arm in (REPEAT, NOISE) else TARGETS["block" if arm.partition(":")[0]
                                                                       in BLOCK_RECIPES else "fp8"]
        pair = base if noise else bases.get(seed)
        fields = {"model": args.preset, "emulate": r.get("emulate"), "precision": args.precision, "arm": arm,
                  "seed": seed}
        if pair is None:
            report["summary"].append({**fields, "recipe": r["recipe"], "steps": steps, "target": target,
                                      "note": f"no {BASE} run of seed {seed}"})
            continue
        s_r = compare(pair, r, steps, args.smooth, target, noise, **fields)
        if arm == REPEAT and "rel_diff" in s_r:  # the same program: a spread, not a result
            s_r["note"], s_r["ok"] = "the baseline's program again, same init: kernel nondeterminism", None
        if arm == NOISE and "rel_diff" in s_r:  # an experiment beside the recipes, no target
            s_r["note"], s_r["ok"] = f"bf16 with FP8-sized noise (sigma {r.get('noise_sigma')}), no rounding", None
        report["summary"].append(s_r)
    report["paired"] = paired_stats(report["summary"])
    log(convergence_table(report))
    path = save_curves(report["runs"], Path(args.out), args.smooth, f"{args.preset}, {args.precision}",
                       tightest_target(report["summary"]))
    report["curves"] = str(path) if path else None
    return report
