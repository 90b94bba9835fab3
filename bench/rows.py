"""Each suite's report -> the result schema's rows (``bench.core.schema``): what RESULTS.md tables are made of.

Pure JSON processing (no torch import), so ``python -m bench results`` runs anywhere; result files written before
the schema go through the same conversion. A suite's case is what was measured (a model, a shape, a setting), its
impl how (an implementation, a kernel, a mode); the metrics are the run's numeric values (per-step lists and nested
detail stay in the file, outside the rows).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from bench.core.schema import make_row, numbers, status_of

Rows = list[dict[str, Any]]


def _runs(suite: str, runs: list[Mapping[str, Any]], case: Callable[[Mapping], Any], impl: Callable[[Mapping], Any],
          extra: Callable[[Mapping], dict] = lambda r: {}) -> Rows:
    out = []
    for r in runs:
        status, note = status_of(r)
        out.append(make_row(suite, case(r), impl(r), {**numbers(r), **extra(r)}, status, note))
    return out


def _key(*names: str) -> Callable[[Mapping], str]:
    """The first of ``names`` that the run has (``?`` when none)."""
    return lambda r: next((str(r[n]) for n in names if r.get(n) is not None), "?")


def _optimizer(r: Mapping[str, Any]) -> dict:
    o = r.get("optimizer_step")
    return {f"optimizer_{k}": v for k, v in numbers(o, ("seconds", "bound_s", "ratio_to_bound")).items()} \
        if isinstance(o, dict) else {}


def train_step(rep: Mapping[str, Any]) -> Rows:
    return _runs("train_step", rep.get("runs", []), _key("model"), _key("impl"))


def deepseek_v3_step(rep: Mapping[str, Any]) -> Rows:
    return _runs("deepseek_v3_step", rep.get("runs", []), _key("model"), _key("impl"), _optimizer)


def precision_step(rep: Mapping[str, Any]) -> Rows:
    return _runs("precision_step", rep.get("runs", []), _key("model"), _key("run", "impl"), _optimizer)


def precision_seeds(rep: Mapping[str, Any]) -> Rows:
    return _runs("precision_seeds", rep.get("runs", []), lambda r: f"seed {r.get('seed')}", _key("mode"))


def memory(rep: Mapping[str, Any]) -> Rows:
    return _runs("memory", rep.get("runs", []), _key("setting"), _key("impl"))


def monitor_overhead(rep: Mapping[str, Any]) -> Rows:
    return _runs("monitor_overhead", rep.get("runs", []), _key("model"),
                 lambda r: f"{r.get('impl')} monitor={'on' if r.get('monitor') else 'off'}")


def doc_mask(rep: Mapping[str, Any]) -> Rows:
    return _runs("doc_mask", rep.get("runs", []), _key("case"), _key("kernel"))


def moe_layer(rep: Mapping[str, Any]) -> Rows:
    out = []
    for shape, s in rep.get("shapes", {}).items():
        ratios = s.get("ratios", {})
        for impl, r in s.get("runs", {}).items():
            status, note = status_of(r)
            m = numbers(r)
            m.update({f"x{k.replace('/', '_')}": v for k, v in numbers(ratios.get(impl, {})).items()})
            if isinstance(r.get("routing"), dict):
                m.update({f"routing_{k}": v for k, v in numbers(r["routing"]).items()})
            out.append(make_row("moe_layer", shape, impl, m, status, note or r.get("experts_implementation", "")))
    return out


def low_precision(rep: Mapping[str, Any]) -> Rows:
    out = []
    for r in rep.get("layer", []) if isinstance(rep.get("layer"), list) else []:
        for impl, v in r.items():
            if not isinstance(v, dict):
                continue
            # a recipe's timings: flat (older reports) or per routing ("learned" / "forced")
            timed = [("", v)] if "ms" in v else [(f" {k}", t) for k, t in v.items() if isinstance(t, dict) and "ms" in t]
            for routing, t in timed:
                status, note = status_of(t)
                out.append(make_row("low_precision", f"layer {r.get('shape', '?')}{routing}", impl, numbers(t),
                                    status, note))
    for r in rep.get("step", []) if isinstance(rep.get("step"), list) else []:
        status, note = status_of(r)
        mode = f" {r['mode']}" if r.get("mode") else ""
        out.append(make_row("low_precision", f"step {r.get('model', '?')}{mode}", str(r.get("recipe", "?")),
                            numbers(r), status, note))
    conv = rep.get("convergence") if isinstance(rep.get("convergence"), dict) else {}
    for r in conv.get("runs", []):
        status, note = status_of(r)
        out.append(make_row("low_precision", f"convergence {conv.get('preset', '?')}", str(r.get("recipe", "?")),
                            numbers(r), status, note))
    return out


def kernels_check(rep: Mapping[str, Any]) -> Rows:
    checks = rep.get("checks", rep.get("rows", []))  # "rows" in files from before the schema
    return [make_row("kernels_check", r.get("shape", "?"), r.get("op", "?"), numbers(r),
                     "ok" if r.get("ok") else "failed") for r in checks if "op" in r]


def saved_tensors(rep: Mapping[str, Any]) -> Rows:
    saved = rep.get("saved", rep.get("rows", []))  # "rows" in files from before the schema
    return [make_row("saved_tensors", f"{r.get('shape')} {r.get('dtype')}", r.get("producer", "?"), numbers(r), "ok")
            for r in saved if "producer" in r]


def scale(rep: Mapping[str, Any]) -> Rows:
    return _runs("scale", rep.get("runs", []), _key("layout", "model"), _key("impl"))


def checkpoint(rep: Mapping[str, Any]) -> Rows:
    impl = "resume" if rep.get("resume") else "save"
    if rep.get("async_save"):
        impl = "async " + impl
    return _runs("checkpoint", [rep], lambda r: f"{r.get('layout')} W={r.get('world')}", lambda r: impl)


def parallel_check(rep: Mapping[str, Any]) -> Rows:
    return _runs("parallel_check", [rep], lambda r: f"{r.get('layout')} W={r.get('world')}", lambda r: "lightning_moe")


def deepep_check(rep: Mapping[str, Any]) -> Rows:
    out = []
    for r in rep.get("results", []):
        check = r.get("check", {}) if isinstance(r.get("check"), dict) else {}
        status, note = status_of(r)
        if status == "ok" and not check.get("ok", False):
            status = "failed"
        out.append(make_row("deepep_check", f"{r.get('shape', '?')} {r.get('routing', '')}".strip(),
                            str(r.get("impl", "deepep")), {**numbers(r), **numbers(check)}, status, note))
    return out


CONVERTERS: dict[str, Callable[[Mapping[str, Any]], Rows]] = {
    f.__name__: f for f in (train_step, moe_layer, precision_step, precision_seeds, deepseek_v3_step, memory,
                            low_precision, doc_mask, checkpoint, kernels_check, monitor_overhead, saved_tensors, scale,
                            parallel_check, deepep_check)}


def rows_for(suite: str, report: Mapping[str, Any]) -> Rows:
    if suite not in CONVERTERS:
        raise ValueError(f"unknown suite {suite!r}; `python -m bench --list` lists {sorted(CONVERTERS)}")
    return CONVERTERS[suite](report)
