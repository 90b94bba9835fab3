"""ParallelDims: the one owner of parallel sizes and device meshes (DESIGN.md, invariant 2).

One piece (about 550 lines): the three views of one world, their meshes and the checks of every size are one
invariant (DESIGN 2): each view's groups must agree with the others'.

One world of ``W`` ranks, seen three ways (ranks are laid out row-major in every view, so ``dp_replicate`` is
the outermost dim of both meshes and its groups are the same in both):

* dense view   ``dp_replicate x dp_shard x cp x tp = W``       attention, embeddings, dense MLP, router, shared experts
* expert view  ``dp_replicate x edp_shard x ep x etp = W``     routed experts (MoE Parallel Folding)
* batch view   ``dp_replicate x dp_shard``                     data loading: tp and cp peers read the same samples

MoE Parallel Folding: inside one data-parallel replica the dense view splits its ``dp_shard * cp * tp`` ranks as
``dp_shard x cp x tp`` and the expert view splits the same ranks as ``edp_shard x ep x etp``. So ``ep`` and
``etp`` may borrow ranks from ``dp_shard``, ``cp`` and ``tp``: EP is not bounded by DP. With W=8, tp=2 and
dp_shard=4 for attention, ep=8 puts one expert shard on every rank; with W=2, tp=2 and ep=2, the ep group *is*
the tp group. ``edp_shard = W / (dp_replicate * ep * etp)`` is derived.

Everything up to :meth:`ParallelDims.build_meshes` is pure arithmetic (no process group): sizes are checked in
``__init__`` and, against a model and a sequence length, in :meth:`ParallelDims.validate`; every violation is a
``ValueError`` that names the fix. ``batch_rank`` / ``rank_groups`` / ``coords`` also work without groups.

:meth:`ParallelDims.build_meshes` makes two root meshes with ``init_device_mesh`` (4 named dims each; size-1 dims
are kept so the names always exist) plus flattened 1-D meshes. FSDP2 requires the DP mesh and a parameter's
TP/EP mesh to come from the same root, hence: dense parameters use :meth:`fsdp_mesh` with ``tp_mesh``; routed
experts use :meth:`expert_fsdp_mesh` with ``ep_mesh`` / ``etp_mesh``. Never mix meshes of the two roots in one
DTensor or one ``fully_shard`` call.

Flattened meshes (all 1-D; built with ``DeviceMesh._flatten`` and kept by reference, because slicing a flattened
dim out of the root mesh by name is deprecated since torch 2.11; the 2-D HSDP mesh of :meth:`fsdp_mesh` joins
``dp_replicate`` and the flattened ``dp_shard_cp`` with ``DeviceMesh._concatenate``, which FSDP2 itself uses on
torch 2.11 and 2.13):

===============  ======  =====================================  ==============================================
name             view    dims                                   used for
===============  ======  =====================================  ==============================================
``dp``           dense   dp_replicate, dp_shard                 batch view (``batch_mesh``)
``dp_shard_cp``  dense   dp_shard, cp                           FSDP shard dim of dense parameters
``dp_cp``        dense   dp_replicate, dp_shard, cp             loss / token-count reductions over data ranks
``cp_tp``        dense   cp, tp                                 ``token_group``: ranks sharing one micro-batch
``world``        dense   dp_replicate, dp_shard, cp, tp         ``global_group``: every rank
``edp``          expert  dp_replicate, edp_shard                ranks holding the same expert shard
``ep_etp``       expert  ep, etp                                ranks holding one layer's full expert set
===============  ======  =====================================  ==============================================

One piece (over 500 lines): the sizes, their validation and the meshes built from them are one object, so
that no mesh exists for sizes that were not checked.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_moe.config import ModelConfig

__all__ = ["ParallelDims", "DENSE_DIMS", "EXPERT_DIMS", "BATCH_DIMS", "FLAT_DIMS"]

DENSE_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS: tuple[str, ...] = ("dp_replicate", "edp_shard", "ep", "etp")
BATCH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard")
# flattened 1-D meshes: name -> (view, dims of that view, outer to inner)
FLAT_DIMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dp": ("dense", ("dp_replicate", "dp_shard")),
    "dp_shard_cp": ("dense", ("dp_shard", "cp")),
    "dp_cp": ("dense", ("dp_replicate", "dp_shard", "cp")),
    "cp_tp": ("dense", ("cp", "tp")),
    "world": ("dense", DENSE_DIMS),
    "edp": ("expert", ("dp_replicate", "edp_shard")),
    "ep_etp": ("expert", ("ep", "etp")),
}
_SIZE_FIELDS = ("dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def _fmt_set(xs: list[int]) -> str:
    return "{" + ", ".join(str(x) for x in xs) + "}"


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(index % s)
        index //= s
    return tuple(reversed(out))


@dataclass
class ParallelDims:
    """Validated parallel sizes of one world, and (after :meth:`build_meshes`) its device meshes.

    Args:
        dp_replicate: replicas (DDP / the replicate dim of HSDP); outermost dim of both views.
        dp_shard: FSDP shard degree of dense parameters; ``-1`` or ``"auto"`` = whatever ``world_size`` leaves
            after ``dp_replicate * cp * tp``. Resolved in place to an int.
        cp: context parallel degree (each sequence split over cp ranks).
        tp: tensor parallel degree of the dense view.
        ep: expert parallel degree (experts split over ep ranks), folded over dp_shard x cp x tp.
        etp: expert tensor parallel degree (each expert's hidden size F split over etp ranks).
        world_size: W; ``None`` = the initialised process group's size, else ``$WORLD_SIZE``, else 1.
    """

    dp_replicate: int = 1
    dp_shard: Union[int, str] = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: Optional[int] = None

    def __post_init__(self) -> None:
        # meshes are plain attributes, not dataclass fields: dataclasses.asdict / replace never touch them
        self._dense_mesh: Optional[DeviceMesh] = None
        self._expert_mesh: Optional[DeviceMesh] = None
        self._flat: dict[str, DeviceMesh] = {}
        if self.world_size is None:
            self.world_size = self._infer_world_size()
        self._validate_sizes()

    # ---- construction ---------------------------------------------------------------------------------
    @staticmethod
    def _infer_world_size() -> int:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_world_size()
        except ImportError:  # pragma: no cover
            pass
        return int(os.environ.get("WORLD_SIZE", "1"))

    # ---- validation (pure) ------------------------------------------------------------------------
    def _validate_sizes(self) -> None:
        W = self.world_size
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ValueError(f"world_size must be a positive int, got {W!r}")
        if isinstance(self.dp_shard, str):
            if self.dp_shard.strip().lower() != "auto":
                raise ValueError(f"dp_shard must be a positive int, -1 or 'auto', got {self.dp_shard!r}")
            self.dp_shard = -1
        for name in _SIZE_FIELDS:
            v = getattr(self, name)
            if name == "dp_shard" and not isinstance(v, bool) and v == -1:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                hint = " (or -1 / 'auto' to fill the world)" if name == "dp_shard" else ""
                raise ValueError(f"{name} must be a positive int{hint}, got {v!r}: set {name}=1 to disable it")
        dpr, cp, tp = self.dp_replicate, self.cp, self.tp
        if self.dp_shard == -1:
            others = dpr * cp * tp
            if W % others != 0:
                raise ValueError(
                    f"dp_shard='auto' cannot fill world_size={W}: dp_replicate*cp*tp = {dpr}*{cp}*{tp} = {others} "
                    f"does not divide {W}; choose dp_replicate, cp and tp whose product is in {_fmt_set(_divisors(W))}"
                )
            self.dp_shard = W // others
        dps = int(self.dp_shard)
        prod = dpr * dps * cp * tp
        if prod != W:
            raise ValueError(
                f"dense view dp_replicate*dp_shard*cp*tp = {dpr}*{dps}*{cp}*{tp} = {prod} != world_size={W}: "
                f"choose sizes whose product is {W}, or set dp_shard='auto' (-1) to fill the world"
            )
        ep, etp = self.ep, self.etp
        replica = dps * cp * tp  # ranks of one data-parallel replica; ep x etp folds over them
        if replica % etp != 0:
            raise ValueError(
                f"expert view: etp={etp} must divide the {replica} ranks of one data-parallel replica "
                f"(dp_shard*cp*tp = {dps}*{cp}*{tp}; world_size={W} / dp_replicate={dpr}): "
                f"choose etp in {_fmt_set(_divisors(replica))}"
            )
        if replica % (ep * etp) != 0:
            ok_ep = [d for d in _divisors(replica) if replica % (d * etp) == 0]
            raise ValueError(
                f"expert view: ep*etp = {ep}*{etp} = {ep * etp} must divide the {replica} ranks of one "
                f"data-parallel replica (dp_shard*cp*tp = {dps}*{cp}*{tp}; world_size={W} / dp_replicate={dpr}): "
                f"choose ep in {_fmt_set(ok_ep)} for etp={etp}, or lower dp_replicate"
            )

    def validate(self, model_config: Optional["ModelConfig"] = None, seq_len: Optional[int] = None) -> "ParallelDims":
        """Check the sizes, and against ``model_config`` / ``seq_len`` when given. Pure: no process group.

        Returns ``self``; raises ``ValueError`` naming the fix.
        """
        self._validate_sizes()
        tp, cp = self.tp, self.cp
        if model_config is not None:
            self._validate_model(model_config)
        if seq_len is not None:
            if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
                raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
            if cp > 1 and seq_len % (2 * cp) != 0:
                ok = [c for c in _divisors(seq_len // 2) if c > 1] if seq_len % 2 == 0 else []
                raise ValueError(
                    f"seq_len={seq_len} is not divisible by 2*cp = {2 * cp} (context parallel cuts each sequence "
                    f"into 2*cp load-balanced causal chunks): make seq_len a multiple of {2 * cp}"
                    + (f", or choose cp in {_fmt_set([1] + ok)}" if seq_len % 2 == 0 else ", or set cp=1")
                )
            div = self.seq_len_divisor
            if tp > 1 and seq_len % div != 0:
                raise ValueError(
                    f"seq_len={seq_len} is not divisible by {div} = tp={tp} x "
                    f"{'2*cp=' + str(2 * cp) if cp > 1 else 'cp=1'} (sequence parallel splits each rank's "
                    f"sequence over the tp ranks): make seq_len a multiple of {div}, or change tp"
                )
        return self

    def _validate_model(self, cfg: "ModelConfig") -> None:
        tp, ep, etp = self.tp, self.ep, self.etp
        moe = cfg.moe
        E = moe.num_experts
        if E == 0:
            if ep != 1 or etp != 1:
                raise ValueError(
                    f"the model is dense (moe.num_experts=0) but ep={ep}, etp={etp}: set ep=1 and etp=1 "
                    "(expert parallelism needs routed experts)"
                )
        else:
            if E % ep != 0:
                ok = [d for d in _divisors(E) if self._replica % (d * etp) == 0]
                raise ValueError(
                    f"ep={ep} does not divide num_experts={E}: choose ep in {_fmt_set(ok)}"
                )
            F = moe.expert_hidden_size
            if F % etp != 0:
                ok = [d for d in _divisors(F) if self._replica % (ep * d) == 0]
                raise ValueError(
                    f"etp={etp} does not divide moe.expert_hidden_size={F} (expert tensor parallel splits each "
                    f"expert's hidden size): choose etp in {_fmt_set(ok)}"
                )
        if tp > 1:
            H = cfg.num_heads
            if H % tp != 0:
                what = "attention heads" if cfg.attention != "mla" else "MLA's heads after its latent projections"
                raise ValueError(
                    f"tp={tp} does not divide num_heads={H} (tensor parallel splits {what}): "
                    f"choose tp in {_fmt_set(_divisors(math.gcd(H, self._replica)))}, or num_heads a multiple of {tp}"
                )
            if cfg.attention != "mla" and cfg.num_kv_heads % tp != 0:
                KV = cfg.num_kv_heads
                raise ValueError(
                    f"tp={tp} does not divide num_kv_heads={KV} (GQA key/value heads are split over tp, not "
                    f"replicated): choose tp in {_fmt_set(_divisors(math.gcd(KV, self._replica)))}"
                )
            D = cfg.hidden_size
            if D % tp != 0:
                raise ValueError(
                    f"tp={tp} does not divide hidden_size={D}: choose tp in "
                    f"{_fmt_set(_divisors(math.gcd(D, self._replica)))}"
                )
            has_dense_mlp = any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
            if has_dense_mlp and cfg.dense_hidden_size % tp != 0:
                FD = cfg.dense_hidden_size
                raise ValueError(
                    f"tp={tp} does not divide dense_hidden_size={FD} (the dense MLP is split over tp): choose tp "
                    f"in {_fmt_set(_divisors(math.gcd(FD, self._replica)))}"
                )
            # shared experts stay whole on every tp rank (they see that rank's own sequence-parallel tokens)
            if cfg.qk_norm == "full":
                raise ValueError(
                    f"qk_norm='full' normalises over all heads and cannot be split by tp={tp}: use tp=1 or "
                    "qk_norm='head'"
                )

    # ---- derived sizes ------------------------------------------------------------------------------
    @property
    def _replica(self) -> int:
        return int(self.dp_shard) * self.cp * self.tp

    @property
    def edp_shard(self) -> int:
        """FSDP shard degree of the routed experts: ``W / (dp_replicate * ep * etp)``."""
        return self._replica // (self.ep * self.etp)

    @property
    def dense_shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, int(self.dp_shard), self.cp, self.tp)

    @property
    def expert_shape(self) -> tuple[int, int, int, int]:
        return (self.dp_replicate, self.edp_shard, self.ep, self.etp)

    @property
    def num_data_shards(self) -> int:
        """Number of distinct data shards (the batch view): ``dp_replicate * dp_shard``."""
        return self.dp_replicate * int(self.dp_shard)

    @property
    def token_group_size(self) -> int:
        """Ranks that share one micro-batch's tokens: ``cp * tp``."""
        return self.cp * self.tp

    @property
    def seq_len_divisor(self) -> int:
        """seq_len must be a multiple of this: ``tp * 2*cp`` with CP (load balancing), else ``tp``."""
        return self.tp * (2 * self.cp if self.cp > 1 else 1)

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return int(self.dp_shard) > 1

    @property
    def dp_enabled(self) -> bool:
        return self.num_data_shards > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Dense parameters are sharded (over ``dp_shard * cp``)."""
        return int(self.dp_shard) * self.cp > 1

    @property
    def expert_fsdp_enabled(self) -> bool:
        """Routed-expert parameters are sharded (over ``edp_shard``)."""
        return self.edp_shard > 1

    # ---- rank arithmetic (pure) ---------------------------------------------------------------------
    def _view(self, view: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
        if view == "dense":
            return DENSE_DIMS, self.dense_shape
        if view == "expert":
            return EXPERT_DIMS, self.expert_shape
        raise ValueError(f"unknown view {view!r}: choose 'dense' or 'expert'")

    def _check_rank(self, rank: int) -> None:
        assert self.world_size is not None
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")

    def coords(self, rank: int, view: str = "dense") -> dict[str, int]:
        """Coordinates of ``rank`` in the ``"dense"`` or ``"expert"`` view (row-major), e.g. ``{"tp": 1, ...}``."""
        self._check_rank(rank)
        names, shape = self._view(view)
        return dict(zip(names, _unravel(rank, shape)))

    def batch_rank(self, global_rank: int) -> int:
        """Index of the data shard ``global_rank`` reads, in ``[0, num_data_shards)``; tp/cp peers share it.

        Pure arithmetic: ``dp_replicate_coord * dp_shard + dp_shard_coord`` of the dense view, i.e.
        ``global_rank // (cp * tp)``. ``ep`` and ``etp`` never change it.
        """
        c = self.coords(global_rank, "dense")
        return c["dp_replicate"] * int(self.dp_shard) + c["dp_shard"]

    def _resolve(self, name: str) -> tuple[str, tuple[str, ...]]:
        if name in FLAT_DIMS:
            return FLAT_DIMS[name]
        if name in DENSE_DIMS:
            return "dense", (name,)
        if name in EXPERT_DIMS:
            return "expert", (name,)
        known = list(dict.fromkeys(DENSE_DIMS + EXPERT_DIMS + tuple(FLAT_DIMS)))
        raise ValueError(f"unknown mesh dim {name!r}; known: {known}")

    def rank_groups(self, name: str) -> list[list[int]]:
        """All groups of the mesh dim (or flattened dim) ``name`` as sorted rank lists. Pure arithmetic."""
        view, dims = self._resolve(name)
        names, shape = self._view(view)
        idx = [names.index(d) for d in dims]
        groups: dict[tuple[int, ...], list[int]] = {}
        assert self.world_size is not None
        for r in range(self.world_size):
            c = _unravel(r, shape)
            key = tuple(v for i, v in enumerate(c) if i not in idx)
            groups.setdefault(key, []).append(r)
        return sorted(groups.values())

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``name`` (e.g. ``group_ranks("ep", 3)``). Pure arithmetic."""
        self._check_rank(rank)
        return next(g for g in self.rank_groups(name) if rank in g)

    # ---- description --------------------------------------------------------------------------------
    def describe(self) -> str:
        """A short human-readable summary of the three views."""
        dps = int(self.dp_shard)
        lines = [
            f"ParallelDims(world_size={self.world_size})",
            f"  dense : dp_replicate={self.dp_replicate} x dp_shard={dps} x cp={self.cp} x tp={self.tp}"
            f"  (dense params sharded over dp_shard*cp={dps * self.cp})",
            f"  expert: dp_replicate={self.dp_replicate} x edp_shard={self.edp_shard} x ep={self.ep} x etp={self.etp}"
            f"  (expert params sharded over edp_shard={self.edp_shard})",
            f"  batch : dp_replicate={self.dp_replicate} x dp_shard={dps} = {self.num_data_shards} data shards"
            f" (cp*tp={self.token_group_size} ranks share each)",
        ]
        if self.world_size and self.world_size > 1 and (self.ep > 1 or self.etp > 1):
            lines.append(f"  ep groups: {self.rank_groups('ep')}" + (
                f", etp groups: {self.rank_groups('etp')}" if self.etp > 1 else ""))
        return "\n".join(lines)

    # ---- meshes -------------------------------------------------------------------------------------
    @property
    def meshes_built(self) -> bool:
        return self._dense_mesh is not None

    def build_meshes(self, device_type: str) -> "ParallelDims":
        """Create the dense and expert meshes and the flattened meshes (see module docstring). Collective:
        every rank must call it, in the same order as other group creations. Returns ``self``."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ParallelDims.build_meshes needs an initialised default process group: call "
                "torch.distributed.init_process_group first"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was sized for world_size={self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks: rebuild ParallelDims with world_size={dist.get_world_size()}"
            )
        if self.meshes_built:
            return self
        dense = init_device_mesh(device_type, self.dense_shape, mesh_dim_names=DENSE_DIMS)
        expert = init_device_mesh(device_type, self.expert_shape, mesh_dim_names=EXPERT_DIMS)
        roots = {"dense": dense, "expert": expert}
        flat: dict[str, Any] = {}
        for name, (view, dims) in FLAT_DIMS.items():
            root = roots[view]
            sub = root if dims == root.mesh_dim_names else root[dims]
            flat[name] = sub._flatten(mesh_dim_name=name)
        self._dense_mesh, self._expert_mesh, self._flat = dense, expert, flat
        return self

    def _need(self) -> None:
        if not self.meshes_built:
            raise RuntimeError("meshes are not built yet: call ParallelDims.build_meshes(device_type) first")

    @property
    def dense_mesh(self) -> "DeviceMesh":
        """4-D mesh ("dp_replicate", "dp_shard", "cp", "tp")."""
        self._need()
        assert self._dense_mesh is not None
        return self._dense_mesh

    @property
    def expert_mesh(self) -> "DeviceMesh":
        """4-D mesh ("dp_replicate", "edp_shard", "ep", "etp")."""
        self._need()
        assert self._expert_mesh is not None
        return self._expert_mesh

    def mesh(self, name: str) -> "DeviceMesh":
        """1-D mesh of a view dim (``"tp"``, ``"ep"``, ...; ``"dp_replicate"`` from the dense view) or a flattened
        dim (``"dp"``, ``"dp_shard_cp"``, ``"dp_cp"``, ``"cp_tp"``, ``"world"``, ``"edp"``, ``"ep_etp"``)."""
        self._need()
        view, _ = self._resolve(name)
        if name in FLAT_DIMS:
            return self._flat[name]
        return (self.dense_mesh if view == "dense" else self.expert_mesh)[name]

    def group(self, name: str) -> "ProcessGroup":
        """ProcessGroup of this rank along ``name`` (see :meth:`mesh`)."""
        return self.mesh(name).get_group()

    @staticmethod
    def _two_d(root: "DeviceMesh", replicate: "DeviceMesh", shard: "DeviceMesh") -> "DeviceMesh":
        from torch.distributed.device_mesh import DeviceMesh

        concat = getattr(DeviceMesh, "_concatenate", None)
        if concat is not None:
            return concat([replicate, shard])
        names = (replicate.mesh_dim_names[0], shard.mesh_dim_names[0])  # type: ignore[index]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return root[names]

    def fsdp_mesh(self) -> "DeviceMesh":
        """FSDP2 mesh of dense parameters: 2-D ("dp_replicate", "dp_shard_cp") for HSDP when dp_replicate > 1,
        else 1-D ("dp_shard_cp",). Same root as ``tp_mesh``."""
        self._need()
        if self.dp_replicate > 1:
            return self._two_d(self.dense_mesh, self.dense_mesh["dp_replicate"], self._flat["dp_shard_cp"])
        return self._flat["dp_shard_cp"]

    def expert_fsdp_mesh(self) -> "DeviceMesh":
        """FSDP2 mesh of routed-expert parameters: 2-D ("dp_replicate", "edp_shard") for HSDP when
        dp_replicate > 1, else 1-D ("edp_shard",). Same root as ``ep_mesh`` / ``etp_mesh``."""
        self._need()
        if self.dp_replicate > 1:
            return self.expert_mesh["dp_replicate", "edp_shard"]
        return self.expert_mesh["edp_shard"]

    @property
    def tp_mesh(self) -> "DeviceMesh":
        return self.mesh("tp")

    @property
    def cp_mesh(self) -> "DeviceMesh":
        return self.mesh("cp")

    @property
    def ep_mesh(self) -> "DeviceMesh":
        return self.mesh("ep")

    @property
    def etp_mesh(self) -> "DeviceMesh":
        return self.mesh("etp")

    @property
    def batch_mesh(self) -> "DeviceMesh":
        """1-D flattened ("dp",) = dp_replicate x dp_shard of the dense view."""
        return self.mesh("dp")

    @property
    def dp_cp_mesh(self) -> "DeviceMesh":
        """1-D flattened ("dp_cp",): every rank holding distinct tokens, up to tp (loss token counts)."""
        return self.mesh("dp_cp")

    @property
    def token_group(self) -> Optional["ProcessGroup"]:
        """Ranks over which ONE micro-batch's tokens are split (cp x tp); None when cp * tp == 1."""
        if self.token_group_size == 1:
            return None
        return self.group("cp_tp")

    @property
    def global_group(self) -> Optional["ProcessGroup"]:
        """All ranks (dp x cp x tp); None when world_size == 1."""
        if self.world_size == 1:
            return None
        return self.group("world")

