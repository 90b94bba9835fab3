"""Memory plan: parameters, and weight, gradient and optimizer-state bytes per layer type for a config."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_moe.config import ModelConfig

# bytes per parameter for (weights, grads, AdamW states) under each Lightning precision setting
PRECISION_BYTES = {
    "bf16-true": (2, 2, 4),  # everything in bf16, two bf16 Adam moments
    "bf16-mixed": (4, 4, 8),  # fp32 master weights, grads and moments
    "32-true": (4, 4, 8),
}


@dataclass
class PlanRow:
    component: str
    params: int
    active: int
    weight_bytes: int
    grad_bytes: int
    optim_bytes: int


def memory_plan(config: ModelConfig, precision: str = "bf16-mixed") -> list[PlanRow]:
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(PRECISION_BYTES)}")
    wb, gb, ob = PRECISION_BYTES[precision]
    rows = []
    for name, c in config.param_breakdown().items():
        n = c["total"]
        rows.append(PlanRow(name, n, c["active"], n * wb, n * gb, n * ob))
    return rows


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def _fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def format_plan(name: str, config: ModelConfig, precision: str = "bf16-mixed") -> str:
    rows = memory_plan(config, precision)
    counts = config.count_params()
    lines = [
        f"{name}: {_fmt_count(counts['total'])} parameters in total, {_fmt_count(counts['active'])} active per token "
        f"({config.num_layers} layers, {config.num_moe_layers} MoE, {config.moe.num_experts} experts, top-{config.moe.top_k})",
        f"precision {precision}: bytes for the whole model on one device (no sharding)",
        f"{'component':<16}{'params':>12}{'active':>12}{'weights':>14}{'grads':>14}{'optimizer':>14}",
    ]
    tot = PlanRow("total", 0, 0, 0, 0, 0)
    for r in rows:
        lines.append(
            f"{r.component:<16}{_fmt_count(r.params):>12}{_fmt_count(r.active):>12}{_fmt_bytes(r.weight_bytes):>14}"
            f"{_fmt_bytes(r.grad_bytes):>14}{_fmt_bytes(r.optim_bytes):>14}"
        )
        tot.params += r.params
        tot.active += r.active
        tot.weight_bytes += r.weight_bytes
        tot.grad_bytes += r.grad_bytes
        tot.optim_bytes += r.optim_bytes
    lines.append(
        f"{'total':<16}{_fmt_count(tot.params):>12}{_fmt_count(tot.active):>12}{_fmt_bytes(tot.weight_bytes):>14}"
        f"{_fmt_bytes(tot.grad_bytes):>14}{_fmt_bytes(tot.optim_bytes):>14}"
    )
    return "\n".join(lines)
