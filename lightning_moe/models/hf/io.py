"""Reading and writing Hugging Face folders: the safetensors reader (only the boxes of local shards are read),
loading into a model of any layout (``from_hf``, ``load_hf_weights_``) and ``save_hf`` (config.json + sharded
safetensors, replaced only once complete)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from lightning_moe.checkpoint.format import clean_param_name
from lightning_moe.config import ModelConfig
from lightning_moe.models.hf.config import (_config_differences, config_from_hf, config_to_hf, export_families,
                                           load_hf_config)
from lightning_moe.models.hf.mapping import _Family, _plan, _Recipe, _Stack

log = logging.getLogger(__name__)


# ====================================================================================================================
# tensor sources
# ====================================================================================================================


class _Source:
    """What the loader needs from a set of named tensors: keys, shapes, and reading a box of one tensor."""

    bytes_read: int
    bytes_by_key: dict[str, int]

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        raise NotImplementedError

    def read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        """``tensor[box]`` (one ``slice`` per dimension, step 1), counting the bytes read."""
        out = self._read(key, box)
        n = out.numel() * out.element_size()
        self.bytes_read += n
        self.bytes_by_key[key] = self.bytes_by_key.get(key, 0) + n
        return out


class HFCheckpointReader(_Source):
    """Lazy reader of a Hugging Face model folder's safetensors: ``model.safetensors`` or
    ``model.safetensors.index.json`` + shards. Only the boxes asked for are read (``safe_open(...).get_slice``).

    ``bytes_read`` / ``bytes_by_key``: bytes read so far (all keys / per key). Use as a context manager or call
    :meth:`close`.
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        try:
            import safetensors
        except ImportError as e:  # pragma: no cover - safetensors is a dependency of the hf extra
            raise ImportError("reading Hugging Face weights needs safetensors: pip install 'lightning_moe[hf]'") from e
        del safetensors
        self.path = os.fspath(path)
        self.bytes_read = 0
        self.bytes_by_key = {}
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map'")
            self._file_of = {}
            for k, fname in weight_map.items():
                if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in (".", ".."):
                    raise ValueError(f"{index}: shard name {fname!r} of {k!r} is not a plain file name in the folder")
                self._file_of[k] = os.path.join(self.path, fname)
        elif os.path.isfile(single):
            self._file_of = None
            self._single = single
        else:
            bins = [f for f in os.listdir(self.path) if f.endswith(".bin")] if os.path.isdir(self.path) else []
            hint = f" (found {bins}: pickle files are never loaded; convert them to safetensors)" if bins else ""
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {self.path!r}{hint}")
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        if self._file_of is None:
            h = self._handle(self._single)
            self._file_of = {k: self._single for k in h.keys()}
        for fname in sorted(set(self._file_of.values())):
            if not os.path.isfile(fname):
                raise ValueError(f"shard {fname!r} named in the index is missing")
            h = self._handle(fname)
            for k in h.keys():
                if self._file_of.get(k) == fname:
                    self._shapes[k] = tuple(h.get_slice(k).get_shape())
        missing = sorted(k for k in self._file_of if k not in self._shapes)
        if missing:
            raise ValueError(f"tensors named in the index are not in their shard: {_fmt(missing)}")

    def _handle(self, fname: str) -> Any:
        from safetensors import SafetensorError, safe_open

        h = self._handles.get(fname)
        if h is None:
            try:
                h = self._stack.enter_context(safe_open(fname, framework="pt", device="cpu"))
            except SafetensorError as e:  # a truncated download, a damaged copy
                raise ValueError(f"{fname} cannot be read as safetensors ({e}): the file is damaged or incomplete; "
                                 "copy or download it again") from e
            self._handles[fname] = h
        return h

    def keys(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def _read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        h = self._handle(self._file_of[key])
        if len(box) == 0:  # a 0-dim tensor
            return h.get_tensor(key)
        return h.get_slice(key)[box]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _DictSource(_Source):
    """An in-memory Hugging Face state dict (e.g. a transformers 5 model's, with fused experts)."""

    def __init__(self, sd: Mapping[str, Tensor]) -> None:
        self.sd = dict(sd)
        self.bytes_read = 0
        self.bytes_by_key = {}

    def keys(self) -> list[str]:
        return sorted(self.sd)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.sd[key].shape)

    def _read(self, key: str, box: tuple[slice, ...]) -> Tensor:
        return self.sd[key].detach()[box]


# import
# ====================================================================================================================


def _fmt(keys: Iterable[str], n: int = 12) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


@dataclass
class HFLoadResult:
    """What :func:`load_hf_weights_` did on this rank."""

    bytes_read: int = 0
    bytes_by_key: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)      # MTP layers (index >= num_layers), tied lm_head
    unexpected: list[str] = field(default_factory=list)   # only with strict=False
    missing: list[str] = field(default_factory=list)      # only with strict=False


def _local_region(t: Tensor) -> tuple[Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, its box in global coordinates) for a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if tuple(local.shape) != tuple(shape):
            raise ValueError(f"cannot locate a DTensor shard: local shape {tuple(local.shape)} != computed {shape}")
        if len(offset) != len(shape):  # rank outside the mesh: nothing local
            offset = (0,) * len(shape)
        return local, tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return t, tuple(slice(0, s) for s in t.shape)


def _model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Our state-dict entries (parameters and persistent buffers) by clean name, as the live tensors."""
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[clean_param_name(name)] = t
    return out


@torch.no_grad()
def _load_from_source(model: nn.Module, src: _Source, hf_config: Mapping[str, Any], *, strict: bool,
                      check_config: bool) -> HFLoadResult:
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    fam = _Family.from_hf(hf_config)
    if check_config:
        want = config_from_hf(hf_config)
        diffs = _config_differences(cfg, want)
        if diffs:
            raise ValueError("the model's config does not match the checkpoint's config.json: " + "; ".join(diffs)
                             + " (build the model from config_from_hf(load_hf_config(path)), or pass "
                             "check_config=False)")
    tensors = _model_tensors(model)
    src_keys = set(src.keys())
    result = HFLoadResult()

    # MTP modules (DeepSeek-V3's layer num_hidden_layers..) and a tied lm_head copy are not ours to load
    used: set[str] = set()
    mtp: set[int] = set()
    for k in sorted(src_keys):
        mm = re.match(r"model\.layers\.(\d+)\.", k)
        if mm and int(mm.group(1)) >= cfg.num_layers:
            result.skipped.append(k)
            mtp.add(int(mm.group(1)))
        elif k == "lm_head.weight" and cfg.tie_embeddings:
            result.skipped.append(k)
    if result.skipped:
        if mtp:
            log.info("Hugging Face import: skipping layers %s (multi-token-prediction modules past num_layers=%d)",
                     sorted(mtp), cfg.num_layers)
        if "lm_head.weight" in result.skipped:
            log.info("Hugging Face import: skipping lm_head.weight (tie_embeddings: the output reuses the embedding)")
    used.update(result.skipped)

    plan = _plan(cfg, fam, tensors.keys(), src_keys)
    missing = sorted({k for r in plan.values() for k in r.keys()} - src_keys)
    # shape checks of every source a recipe reads
    wrong = []
    for r in plan.values():
        for k, shp in r.expected().items():
            if k in src_keys and tuple(src.shape(k)) != tuple(shp):
                wrong.append(f"{k}: checkpoint {tuple(src.shape(k))} vs expected {tuple(shp)}")
    if wrong:
        raise ValueError("Hugging Face tensors with unexpected shapes: " + "; ".join(sorted(set(wrong))[:12]))
    for ours, r in plan.items():
        if tuple(tensors[ours].shape) != _our_shape(r, tensors[ours]):
            raise ValueError(f"our tensor {ours} has shape {tuple(tensors[ours].shape)}, its Hugging Face source "
                             f"gives {_our_shape(r, tensors[ours])}")
    for r in plan.values():
        used.update(r.keys())
    unexpected = sorted(src_keys - used)
    if missing:
        if strict:
            raise ValueError(f"Hugging Face checkpoint lacks tensors the model needs: {_fmt(missing)}")
        result.missing = missing
    if unexpected:
        if strict:
            raise ValueError(f"Hugging Face checkpoint holds tensors the model has no place for: {_fmt(unexpected)}")
        result.unexpected = unexpected

    with torch.no_grad():
        for ours, r in plan.items():
            if any(k in missing for k in r.keys()):
                continue
            t = tensors[ours]
            if t.is_meta:
                raise ValueError(f"{ours} is on the meta device: materialise the model (to_empty) before loading")
            local, region = _local_region(t)
            if any(s.stop <= s.start for s in region) and len(region) > 0:
                continue
            val = r.read(src, region)
            if tuple(val.shape) != tuple(local.shape):
                raise ValueError(f"{ours}: read {tuple(val.shape)} for a local shard of {tuple(local.shape)}")
            local.copy_(val.to(dtype=local.dtype, device=local.device))
    model.reset_buffers()  # RoPE tables (garbage after to_empty), bias-update counts
    result.bytes_read = src.bytes_read
    result.bytes_by_key = dict(src.bytes_by_key)
    return result


def _our_shape(r: _Recipe, t: Tensor) -> tuple[int, ...]:
    if isinstance(r, _Stack):
        return (len(r.keys_),) + tuple(r.src_shape)
    if r.offset:  # fused gate_up: our half of dim 1
        return tuple(t.shape)
    return tuple(r.src_shape)


def load_hf_weights_(model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True,
                     check_config: bool = True, hf_config: Optional[Mapping[str, Any]] = None) -> HFLoadResult:
    """Fill ``model`` (a :class:`~lightning_moe.models.transformer.MoETransformer`, plain or parallelized: its
    parameters may be DTensors) from the Hugging Face folder ``path`` in place.

    Each parameter reads only the global box of its local shard (experts of this EP rank, rows of this FSDP/TP
    shard). Every checkpoint tensor must be used and every parameter filled, else a ValueError naming the keys
    (``strict=False``: report them in the result instead). Tensors of layers past ``num_layers`` (DeepSeek-V3's
    multi-token-prediction modules) are skipped with a log line. ``check_config``: the model's config must compute
    what ``config.json`` describes (ValueError naming the differing fields). RoPE tables are rebuilt, so a model
    materialised with ``to_empty`` is ready to run after this call. Returns the bytes read and what was skipped.
    """
    hf_config = load_hf_config(path) if hf_config is None else hf_config
    with HFCheckpointReader(path) as reader:
        return _load_from_source(model, reader, hf_config, strict=strict, check_config=check_config)


def load_hf_state_dict_(model: nn.Module, hf_state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any], *,
                        strict: bool = True, check_config: bool = True) -> HFLoadResult:
    """:func:`load_hf_weights_` from an in-memory Hugging Face state dict (per-expert or transformers 5's fused
    ``gate_up_proj`` / ``down_proj`` experts); ``hf_config`` is the config dict (``hf_model.config.to_dict()``)."""
    return _load_from_source(model, _DictSource(hf_state_dict), hf_config, strict=strict, check_config=check_config)


def from_hf(path: Union[str, os.PathLike], *, device: Union[str, torch.device] = "cpu",
            dtype: Optional[torch.dtype] = None, **overrides: Any) -> nn.Module:
    """A single-process :class:`MoETransformer` with the weights of the Hugging Face folder ``path``."""
    from lightning_moe.models.transformer import MoETransformer

    hf = load_hf_config(path)
    cfg = config_from_hf(hf, **overrides)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    load_hf_weights_(model, path, hf_config=hf, check_config=False)
    return model


# ====================================================================================================================
# export
# ====================================================================================================================


def _full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def to_hf_state_dict(state_dict: Mapping[str, Tensor], cfg: ModelConfig, model_type: str, *, keep: bool = True
                     ) -> dict[str, Tensor]:
    """Our state dict as the Hugging Face tensors of a ``model_type`` checkpoint on disk (per-expert keys;
    DeepSeek-V3 rope rows interleaved). Tensors are fresh copies. DTensors are gathered one at a time (a collective:
    every rank calls this); ``keep=False`` drops each gathered tensor at once (ranks that do not write)."""
    sd = {clean_param_name(k): v for k, v in state_dict.items()}
    fam = _Family(model_type, rope_interleave=(model_type == "deepseek_v3"))
    plan = _plan(cfg, fam, sd.keys(), None)
    out: dict[str, Tensor] = {}
    for ours, r in plan.items():
        t = _full(sd[ours]).detach()
        if not keep:
            del t
            continue
        if isinstance(r, _Stack):
            for j, k in enumerate(r.keys_):
                out[k] = t[j].clone().contiguous()
        else:
            assert not r.offset, "export never writes fused experts"
            if r.perm is not None:
                inv = torch.empty(len(r.perm), dtype=torch.long)
                inv[torch.tensor(r.perm, dtype=torch.long)] = torch.arange(len(r.perm))
                t = t[inv]
            out[r.key] = t.clone().contiguous()
    if keep and model_type == "deepseek_v3" and not cfg.moe.expert_bias:
        # transformers' router always has the correction bias; ours is off: zero computes the same choice
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = torch.zeros(cfg.moe.num_experts)
    return out


def save_hf(state_dict_or_model: Union[nn.Module, Mapping[str, Tensor]], out_dir: Union[str, os.PathLike],
            cfg: Optional[ModelConfig] = None, *, model_type: str, max_shard_bytes: int = 5 * 2**30,
            dtype: Optional[torch.dtype] = None, extra_config: Optional[Mapping[str, Any]] = None
            ) -> Optional[list[str]]:
    """Write a Hugging Face folder (``config.json`` + safetensors, sharded with ``model.safetensors.index.json``
    when larger than ``max_shard_bytes``) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    ``state_dict_or_model``: our model (its config is used when ``cfg`` is None) or state dict; DTensors are gathered
    with ``full_tensor()``, so under torch.distributed every rank must call this; rank 0 writes. ``dtype``: cast
    floating tensors (the router and its bias stay as given). ``extra_config``: entries added to ``config.json``
    (e.g. the tokenizer's ``bos_token_id`` / ``eos_token_id``; they are null otherwise). The folder is replaced only
    once complete. Returns the written file names on the writing rank, None elsewhere.
    """
    import torch.distributed as dist

    if isinstance(state_dict_or_model, nn.Module):
        cfg = cfg if cfg is not None else state_dict_or_model.config  # type: ignore[assignment]
        sd = state_dict_or_model.state_dict()
    else:
        sd = dict(state_dict_or_model)
    if cfg is None:
        raise ValueError("save_hf needs cfg (the ModelConfig) when given a state dict")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    try:
        hf_cfg = config_to_hf(cfg, model_type, dtype=dtype)  # validates before any gathering
    except ValueError as e:
        others = {mt: why for mt, why in export_families(cfg).items() if mt != model_type}
        fits = [mt for mt, why in others.items() if why is None]
        stops = "; ".join(f"{mt}: {why}" for mt, why in others.items() if why is not None)
        raise ValueError(f"{e}. " + (f"Families that hold this model: {', '.join(fits)} (model_type="
                                      f"{fits[0]!r}); " if fits else "No other family holds this model: ") + stops
                         ) from None
    hf_cfg.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf_cfg.update(extra_config or {})
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    tensors = to_hf_state_dict(sd, cfg, model_type, keep=rank == 0)  # gathers DTensors (collective)
    if rank != 0:
        if distributed:
            dist.barrier()
        return None
    if dtype is not None:
        for k, v in tensors.items():
            if v.is_floating_point() and not (k.endswith(".gate.weight") or k.endswith("e_score_correction_bias")):
                tensors[k] = v.to(dtype)
    try:
        files = _write_folder(tensors, hf_cfg, os.fspath(out_dir), max_shard_bytes)
    finally:
        if distributed:
            dist.barrier()
    return files


def _write_folder(tensors: dict[str, Tensor], hf_cfg: dict[str, Any], out_dir: str, max_shard_bytes: int
                  ) -> list[str]:
    from safetensors.torch import save_file

    if "dtype" not in hf_cfg:
        dts = {str(v.dtype).replace("torch.", "") for k, v in tensors.items() if ".gate." not in k}
        hf_cfg["dtype"] = dts.pop() if len(dts) == 1 else "float32"
    # greedy shards in key order (a tensor larger than the limit gets a shard of its own)
    shards: list[list[str]] = [[]]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".hf-export-", dir=parent)
    try:
        names = []
        weight_map = {}
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, keys in zip(names, shards):
            save_file({k: tensors[k] for k in keys}, os.path.join(tmp, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in keys})
        if len(shards) > 1:
            total = sum(v.numel() * v.element_size() for v in tensors.values())
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                          indent=2)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_cfg, f, indent=2, sort_keys=True)
        # replace the target only once everything is written
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=".hf-export-old-", dir=parent)
            os.rmdir(old)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(os.listdir(out_dir))
    return files
