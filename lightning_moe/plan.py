"""Memory plan: parameters, and weight, gradient and optimizer-state bytes per layer type for a config.

Two views:

* :func:`memory_plan` / :func:`format_plan`: the whole model on one device (no sharding).
* :func:`layout_plan` / :func:`format_layout_plan`: the bytes ONE GPU holds under a parallel layout
  (:class:`~lightning_moe.parallel.dims.ParallelDims`), following what ``parallel/parallelize.py`` does:

  ==================  =====================================  ============================================
  component           split over                             why
  ==================  =====================================  ============================================
  embedding, lm_head  tp (vocab rows) x dp_shard*cp (FSDP)   Rowwise / Colwise TP, FSDP2 on the dense mesh
  attention           tp (heads) x dp_shard*cp               per-head qk norms are tp-replicated; MLA's latent
                                                             down-projections and norms too (heads split after)
  dense_mlp           tp (hidden) x dp_shard*cp
  norms, final_norm   dp_shard*cp                            SequenceParallel: replicated over tp
  router              dp_shard*cp                            replicated over tp; fp32 under every precision;
                                                             the expert-bias buffer is not sharded at all
  shared_experts      dp_shard*cp                            replicated over tp (fed sequence-parallel tokens)
  routed_experts      ep x etp x edp_shard                   Shard(0) over ep, F over etp, FSDP over edp_shard
  ==================  =====================================  ============================================

  ``dp_replicate`` (HSDP replicas) never divides anything. Splits are taken as even (FSDP's padding of dim 0 to a
  multiple of the shard count is ignored; each component rounds up). Activations, FSDP all-gather buffers and other
  temporaries are not counted.

:func:`alltoall_volume` gives the bytes one GPU sends per micro-batch (forward + backward) through the all-to-all
dispatcher, the main communication cost of expert parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lightning_moe.config import ModelConfig
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.parallel.dims import ParallelDims
from lightning_moe.parallel.layout import (
    block_relative,
    check_recompute_num_layers,
    format_activation_checkpointing,
    parse_activation_checkpointing,
    split_factors,
)

# bytes per parameter for (weights, grads, AdamW states) under each Lightning precision setting
PRECISION_BYTES = {
    "bf16-true": (2, 2, 4),  # everything in bf16, two bf16 Adam moments
    "bf16-true+master": (2, 2, 12),  # bf16 weights and grads; fp32 master and moments (master_dtype="fp32")
    "bf16-mixed": (4, 4, 8),  # fp32 master weights, grads and moments
    "32-true": (4, 4, 8),
}
FP32_BYTES = (4, 4, 8)  # the router weight stays fp32 whatever the precision (TopKRouter._apply)
ACT_BYTES = 2  # bf16 activations through the dispatcher


@dataclass
class PlanRow:
    component: str
    params: int
    active: int
    weight_bytes: int
    grad_bytes: int
    optim_bytes: int


@dataclass
class LayoutRow:
    """One component under a layout: global parameter count, the parameters and bytes ONE GPU holds."""

    component: str
    params: int
    local_params: int
    split: str  # human-readable: how the component is divided, e.g. "tp2 x fsdp4"
    weight_bytes: int
    grad_bytes: int
    optim_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optim_bytes


@dataclass
class AllToAllPlan:
    """Bytes one GPU sends through the all-to-all dispatcher for one micro-batch (forward + backward).

    tokens_per_rank: T = micro_batch * seq_len / (tp * cp) (sequence parallel: every rank routes its own tokens).
    rows_per_rank: rows each rank dispatches per MoE layer (T * k dropless; E * capacity with pad_to_capacity).
    transfers: all-to-alls per MoE layer: dispatch and combine, in forward and backward (4), plus the forward
        again when full activation checkpointing recomputes it (6); selective recomputation never re-runs them.
        With ``recompute_num_layers`` covering only some MoE layers: 4, and ``recomputed_layers`` says how many
        layers add 2 more.
    recomputed_layers: MoE layers whose forward full activation checkpointing re-runs (with its 2 all-to-alls).
    ep_bytes: sum over MoE layers and transfers of rows * D * 2 bytes * (ep - 1) / ep (the part leaving the rank).
    etp_bytes: the all-gather / reduce-scatter over etp of the received rows: rows * D * 2 bytes * (etp - 1).
    """

    tokens_per_rank: int
    rows_per_rank: int
    transfers: int
    num_moe_layers: int
    ep_bytes: int
    etp_bytes: int
    act_bytes: int = ACT_BYTES
    recomputed_layers: int = 0

    @property
    def total_bytes(self) -> int:
        return self.ep_bytes + self.etp_bytes


@dataclass
class LayoutPlan:
    dims: ParallelDims
    precision: str
    seq_len: int
    micro_batch: int
    activation_checkpointing: str  # "none", "full" or the recomputed kinds, comma-separated
    rows: list[LayoutRow] = field(default_factory=list)
    a2a: Optional[AllToAllPlan] = None

    def total(self) -> LayoutRow:
        t = LayoutRow("total", 0, 0, "", 0, 0, 0)
        for r in self.rows:
            t.params += r.params
            t.local_params += r.local_params
            t.weight_bytes += r.weight_bytes
            t.grad_bytes += r.grad_bytes
            t.optim_bytes += r.optim_bytes
        return t


def _check_precision(precision: str) -> tuple[int, int, int]:
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(PRECISION_BYTES)}")
    return PRECISION_BYTES[precision]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _component(fqn: str) -> str:
    """The param_breakdown component a state-dict entry of the built-in model belongs to."""
    rel = block_relative(fqn)
    for prefix, name in (("tok_embeddings.", "embedding"), ("output.", "lm_head"), ("norm.", "final_norm")):
        if fqn.startswith(prefix):
            return name
    for prefix, name in (("attention_norm.", "norms"), ("ffn_norm.", "norms"), ("attention.", "attention"),
                         ("feed_forward.", "dense_mlp"), ("moe.router.", "router"), ("moe.experts.", "routed_experts"),
                         ("moe.shared_experts.", "shared_experts")):
        if rel.startswith(prefix):
            return name
    raise AssertionError(f"no component for {fqn!r}")  # pragma: no cover - the built-in model's names


_FACTOR_ORDER = ("tp", "fsdp", "ep", "etp", "edp")


def layout_rows(config: ModelConfig, dims: ParallelDims, precision: str = "bf16-mixed") -> list[LayoutRow]:
    """Per component: the parameters and the weight / gradient / optimizer bytes ONE GPU holds under ``dims``.

    Counted tensor by tensor on the meta-device model with the splits of :func:`~lightning_moe.parallel.layout.
    split_factors` (the rules ``parallelize`` applies); persistent buffers (the expert bias) are not split."""
    wb, gb, ob = _check_precision(precision)
    with torch.device("meta"):
        model = MoETransformer(config)
    params = dict(model.named_parameters())
    order = list(config.param_breakdown())
    rows = {name: LayoutRow(name, 0, 0, "-", 0, 0, 0) for name in order}
    labels: dict[str, dict[str, int]] = {name: {} for name in order}
    for fqn, t in model.state_dict().items():
        trainable = fqn in params
        comp = _component(fqn)
        factors = split_factors(fqn, dims) if trainable else {}
        div = math.prod(factors.values())
        local = _ceil_div(t.numel(), div)
        w, g, o = FP32_BYTES if comp == "router" else (wb, gb, ob)
        row = rows.setdefault(comp, LayoutRow(comp, 0, 0, "-", 0, 0, 0))
        row.params += t.numel()
        row.local_params += local
        row.weight_bytes += local * w
        if trainable:
            row.grad_bytes += local * g
            row.optim_bytes += local * o
        for k, v in factors.items():
            labels.setdefault(comp, {})[k] = max(v, labels[comp].get(k, 1))
    for comp, row in rows.items():
        f = labels.get(comp, {})
        row.split = " x ".join(f"{k}{f[k]}" for k in _FACTOR_ORDER if f.get(k, 1) > 1) or "-"
    return [r for r in rows.values() if r.params > 0]


def alltoall_volume(
    config: ModelConfig,
    dims: ParallelDims,
    seq_len: int,
    micro_batch: int = 1,
    activation_checkpointing: "str | list[str]" = "none",
    act_bytes: int = ACT_BYTES,
    recompute_num_layers: Optional[int] = None,
) -> AllToAllPlan:
    """Bytes one GPU sends through the all-to-all dispatcher for one micro-batch, forward and backward.

    Each rank routes T = micro_batch * seq_len / (tp * cp) tokens per MoE layer and dispatches T * k rows of D
    activations (dropless; ``E * capacity`` rows with ``pad_to_capacity``, at most ``E * capacity`` with a capacity
    factor), of which a fraction (ep - 1) / ep leaves the rank under uniform routing. Dispatch and combine, forward
    and backward: 4 transfers per MoE layer (6 with full activation checkpointing, which reruns the forward). With
    etp > 1 the received rows (as many as were sent, balanced) are all-gathered over etp in dispatch and
    reduce-scattered in combine: (etp - 1) * rows * D * act_bytes per transfer. ``recompute_num_layers`` (with
    ``"full"``): only the MoE layers among the first n blocks re-run their forward.
    """
    kinds = parse_activation_checkpointing(activation_checkpointing)
    check_recompute_num_layers(recompute_num_layers, kinds, config.num_layers)
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive int (sequences per data-parallel rank), got {micro_batch!r}")
    tokens = micro_batch * seq_len
    if tokens % (dims.tp * dims.cp):
        raise ValueError(
            f"micro_batch*seq_len = {tokens} is not divisible by tp*cp = {dims.tp * dims.cp}: make seq_len a multiple "
            f"of {dims.seq_len_divisor}"
        )
    T = tokens // (dims.tp * dims.cp)
    m, L, D = config.moe, config.num_moe_layers, config.hidden_size
    rows = T * m.top_k if m.num_experts else 0
    if m.num_experts and m.capacity_factor is not None:
        cap_rows = m.num_experts * int(math.ceil(m.capacity_factor * T * m.top_k / m.num_experts))  # as the router
        rows = cap_rows if m.pad_to_capacity else min(rows, cap_rows)
    # selective kinds hold no collective; full recomputation re-runs the forward's dispatch and combine
    blocks = config.num_layers if recompute_num_layers is None else recompute_num_layers
    redone = sum(config.is_moe_layer(i) for i in range(blocks)) if "full" in kinds else 0
    transfers = 6 if L and redone == L else 4
    per_transfer = rows * D * act_bytes
    total = (4 * L + 2 * redone) * per_transfer
    return AllToAllPlan(T, rows, transfers, L, total * (dims.ep - 1) // dims.ep, total * (dims.etp - 1), act_bytes,
                        redone)


def layout_plan(
    config: ModelConfig,
    dims: ParallelDims,
    precision: str = "bf16-mixed",
    seq_len: Optional[int] = None,
    micro_batch: int = 1,
    activation_checkpointing: "str | list[str]" = "none",
    recompute_num_layers: Optional[int] = None,
) -> LayoutPlan:
    """Validate ``dims`` against the model and ``seq_len`` (ValueError naming the fix), then the per-GPU bytes of
    every component and the all-to-all volume. ``seq_len`` None = ``min(4096, config.max_seq_len)``;
    ``recompute_num_layers`` as in :class:`~lightning_moe.MoEParallelStrategy`."""
    _check_precision(precision)
    if seq_len is None:
        seq_len = min(4096, config.max_seq_len)
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={config.max_seq_len}: lower seq_len")
    dims.validate(config, seq_len)
    ac = format_activation_checkpointing(parse_activation_checkpointing(activation_checkpointing))
    return LayoutPlan(
        dims, precision, seq_len, micro_batch, ac,
        rows=layout_rows(config, dims, precision),
        a2a=alltoall_volume(config, dims, seq_len, micro_batch, activation_checkpointing,
                            recompute_num_layers=recompute_num_layers),
    )


def memory_plan(config: ModelConfig, precision: str = "bf16-mixed") -> list[PlanRow]:
    """The whole model on one device: the layout plan of a world of one."""
    active = {k: v["active"] for k, v in config.param_breakdown().items()}
    return [
        PlanRow(r.component, r.params, active[r.component], r.weight_bytes, r.grad_bytes, r.optim_bytes)
        for r in layout_rows(config, ParallelDims(world_size=1), precision)
    ]


# ---- formatting -------------------------------------------------------------------------------------------


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


def _header(name: str, config: ModelConfig) -> str:
    counts = config.count_params()
    return (
        f"{name}: {_fmt_count(counts['total'])} parameters in total, {_fmt_count(counts['active'])} active per token "
        f"({config.num_layers} layers, {config.num_moe_layers} MoE, {config.moe.num_experts} experts, "
        f"top-{config.moe.top_k})"
    )


def format_plan(name: str, config: ModelConfig, precision: str = "bf16-mixed") -> str:
    rows = memory_plan(config, precision)
    lines = [
        _header(name, config),
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


def format_layout_plan(name: str, config: ModelConfig, plan: LayoutPlan) -> str:
    d = plan.dims
    dps = int(d.dp_shard)
    lines = [
        _header(name, config),
        f"layout: world {d.world_size}",
        f"  dense : dp_replicate={d.dp_replicate} x dp_shard={dps} x cp={d.cp} x tp={d.tp}  "
        f"(attention, embeddings, norms, router, shared experts; FSDP over dp_shard*cp={dps * d.cp})",
        f"  expert: dp_replicate={d.dp_replicate} x edp_shard={d.edp_shard} x ep={d.ep} x etp={d.etp}  "
        f"(routed experts; FSDP over edp_shard={d.edp_shard})",
        f"  batch : dp_replicate={d.dp_replicate} x dp_shard={dps} = {d.num_data_shards} data shards of "
        f"micro_batch={plan.micro_batch} x seq_len={plan.seq_len} (cp*tp={d.token_group_size} ranks share each)",
        f"precision {plan.precision}: PER-GPU bytes (router fp32 under every precision; nothing is divided by "
        f"dp_replicate)",
        f"{'component':<16}{'params':>10}{'per GPU':>10}  {'split over':<22}{'weights':>11}{'grads':>11}"
        f"{'optimizer':>11}{'sum':>11}",
    ]

    def fmt(r: LayoutRow) -> str:
        return (
            f"{r.component:<16}{_fmt_count(r.params):>10}{_fmt_count(r.local_params):>10}  {r.split:<22}"
            f"{_fmt_bytes(r.weight_bytes):>11}{_fmt_bytes(r.grad_bytes):>11}{_fmt_bytes(r.optim_bytes):>11}"
            f"{_fmt_bytes(r.total_bytes):>11}"
        )

    lines += [fmt(r) for r in plan.rows]
    lines.append(fmt(plan.total()))
    a = plan.a2a
    assert a is not None
    ac = plan.activation_checkpointing
    if a.num_moe_layers == 0 or (d.ep == 1 and d.etp == 1):
        lines.append("all-to-all: none (ep=1 and etp=1: every rank computes all experts locally)")
    else:
        if a.transfers == 6:
            passes = "forward, recomputed forward (activation_checkpointing=full), backward"
        elif "full" in ac.split(","):
            passes = (f"forward, backward; + 2 in each of the {a.recomputed_layers} MoE layers whose forward full "
                      "recomputation re-runs (recompute_num_layers)")
        else:
            passes = "forward, backward" + ("" if ac == "none" else f"; recomputing {ac} re-runs no all-to-all")
        lines.append(
            f"all-to-all per GPU per micro-batch (alltoall dispatcher): {_fmt_bytes(a.total_bytes)} sent "
            f"= {_fmt_bytes(a.ep_bytes)} over ep" + (f" + {_fmt_bytes(a.etp_bytes)} over etp" if d.etp > 1 else "")
        )
        lines.append(
            f"  T = micro_batch*seq_len/(tp*cp) = {a.tokens_per_rank} tokens/rank, {a.rows_per_rank} rows of "
            f"D={config.hidden_size} x {a.act_bytes} B, fraction (ep-1)/ep = {d.ep - 1}/{d.ep} leaves the rank; "
            f"{a.transfers} transfers (dispatch+combine; {passes}) x {a.num_moe_layers} MoE layers"
            + ("; etp: all-gather/reduce-scatter of (etp-1) x the received rows" if d.etp > 1 else "")
        )
    lines.append(
        f"assumptions: activations bf16 ({ACT_BYTES} B) in the dispatcher; uniform, dropless routing; even splits "
        "(FSDP padding ignored); NOT counted: activations, FSDP all-gather buffers and other temporaries; "
        "multiply the all-to-all by accumulate_grad_batches for one optimizer step"
    )
    return "\n".join(lines)
