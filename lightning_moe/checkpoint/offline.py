"""Reading a checkpoint of any layout in one process, without a process group: what ``generate``, ``export``,
``MoELanguageModel(upcycle_from=...)`` and ``load_for_generation`` use.

- a Lightning ``.ckpt`` file: ``torch.load(weights_only=True)``;
- a distributed checkpoint directory (``ModelParallelStrategy`` / ``MoEParallelStrategy``): the
  torch.distributed.checkpoint shards, resharded to full tensors by DCP, plus :data:`~.format.META_FILE`.

Nothing in the files is executed. Where the optimizer state holds fp32 master weights they are read instead of the
(bf16) parameters.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_moe.checkpoint.format import DCP_METADATA_FILE as _DCP_METADATA
from lightning_moe.checkpoint.format import META_FILE as _LIGHTNING_META
from lightning_moe.checkpoint.publish import resolve
from lightning_moe.config import ModelConfig, resolve_model_config
from lightning_moe.models.transformer import MoETransformer

__all__ = ["load_for_generation", "checkpoint_tokenizer"]


def _config_from_hparams(hparams: Any, where: str) -> ModelConfig:
    if not isinstance(hparams, dict) or "config" not in hparams:
        raise ValueError(f"{where} holds no hyper_parameters['config']: not a lightning_moe MoELanguageModel checkpoint")
    return resolve_model_config(hparams["config"])


def _safe_torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling refused (weights_only) or not a torch file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"cannot read {path} as a weights-only torch checkpoint: {first}") from err


def _build_empty(config: ModelConfig, device: Union[str, torch.device]) -> MoETransformer:
    """The model with uninitialised parameters on ``device`` (no wasted random init); non-persistent buffers
    (rope tables, expert-bias counters) rebuilt, since no checkpoint holds them."""
    with torch.device("meta"):
        model = MoETransformer(config)
    model.to_empty(device=device)
    model.reset_buffers()
    return model


def _checkpoint_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    floats = [d for d in dtypes if d.is_floating_point]
    # the parameters' dtype: the most common floating dtype (routers stay fp32 under bf16-true)
    return max(set(floats), key=floats.count) if floats else torch.float32


_MASTER = "master"  # MasterAdamW's state entry: the fp32 master copy of a low-precision parameter


def _load_lightning_file(path: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The config and the weights: the parameters, or their fp32 masters where the optimizer state holds them."""
    ckpt = _safe_torch_load(path)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    config = _config_from_hparams(ckpt.get("hyper_parameters"), str(path))
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    if not state:
        raise ValueError(f"{path} holds no 'model.*' weights: not a lightning_moe MoELanguageModel checkpoint")
    for osd in (ckpt.get("optimizer_states") or [])[:1]:  # by parameter name (lightning_moe writes it so)
        for name, s in (osd.get("state") or {}).items() if isinstance(osd, dict) else ():
            key = name[len("model."):] if isinstance(name, str) and name.startswith("model.") else None
            if key in state and isinstance(s, dict) and isinstance(s.get(_MASTER), Tensor):
                state[key] = s[_MASTER]
    return config, state


def _load_distributed_dir(path: Path, model_device: Union[str, torch.device]) -> tuple[ModelConfig, MoETransformer, torch.dtype]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta_file = path / _LIGHTNING_META
    if not meta_file.is_file() or not (path / _DCP_METADATA).is_file():
        raise ValueError(
            f"{path} is a directory but not a distributed Lightning checkpoint (expected {_LIGHTNING_META} and "
            f"{_DCP_METADATA} in it)"
        )
    meta = _safe_torch_load(meta_file)
    config = _config_from_hparams(meta.get("hyper_parameters") if isinstance(meta, dict) else None, str(meta_file))
    reader = FileSystemReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    prefix = "state_dict.model."
    dtypes = [getattr(getattr(m, "properties", None), "dtype", None) for k, m in stored.items() if k.startswith(prefix)]
    if not dtypes:
        raise ValueError(f"{path} holds no '{prefix}*' tensors: not a lightning_moe MoELanguageModel checkpoint")
    model = _build_empty(config, model_device)
    wanted = {"model." + k: v for k, v in model.state_dict().items()}
    missing = sorted(k for k in wanted if "state_dict." + k not in stored)
    extra = sorted(k[len("state_dict."):] for k in stored if k.startswith(prefix) and k[len("state_dict."):] not in wanted)
    if missing or extra:
        raise ValueError(f"{path} does not match its own config: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in wanted.items():
        shape = getattr(stored["state_dict." + k], "size", None)
        if shape is not None and tuple(shape) != tuple(v.shape):
            raise ValueError(f"{path}: {k} has shape {tuple(shape)} in the checkpoint, {tuple(v.shape)} in the model")
    # the fp32 masters of MasterAdamW where the optimizer state holds them (they are the weights; the parameters
    # are their rounding), else the parameters: read straight into the model, in one process
    masters = {k: v for k, v in wanted.items() if f"optimizer_0.state.{k}.{_MASTER}" in stored}
    request: dict[str, Any] = {"state_dict": {k: v for k, v in wanted.items() if k not in masters}}
    if masters:
        request["optimizer_0"] = {"state": {k: {_MASTER: v} for k, v in masters.items()}}
        dtypes = [d for k, m in stored.items() if k.startswith(prefix) and k[len("state_dict."):] not in masters
                  for d in [getattr(getattr(m, "properties", None), "dtype", None)]]
        dtypes += [stored[f"optimizer_0.state.{k}.{_MASTER}"].properties.dtype for k in masters]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(request, storage_reader=reader, no_dist=True)
    return config, model, _checkpoint_dtype([d for d in dtypes if d is not None])


def checkpoint_tokenizer(ckpt_path: Union[str, os.PathLike]) -> Optional[str]:
    """The local Hugging Face tokenizer folder a checkpoint was trained with (``TextDataModule(tokenizer=...)``,
    kept in its ``datamodule_hyper_parameters``); None for the byte tokenizer or a checkpoint that does not say."""
    path = Path(os.path.expanduser(str(ckpt_path)))
    meta = path / _LIGHTNING_META if path.is_dir() else path
    if not meta.is_file():
        return None
    try:  # mmap: the tensors are not read
        ckpt = torch.load(meta, map_location="cpu", weights_only=True, mmap=not path.is_dir())
    except Exception:
        return None  # load_for_generation names what is wrong with the file
    tokenizer = (ckpt.get("datamodule_hyper_parameters") or {}).get("tokenizer") if isinstance(ckpt, dict) else None
    return str(tokenizer) if tokenizer else None


def load_for_generation(ckpt_path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu",
                        dtype: Optional[torch.dtype] = None) -> tuple[MoETransformer, ModelConfig]:
    """A ``MoETransformer`` in eval mode (no gradients) and its config, from a checkpoint of any layout, in one
    process and without a process group:

    - a Lightning ``.ckpt`` file (``trainer.save_checkpoint`` with a single-device strategy, or a parallel one with
      ``save_distributed_checkpoint=False``): read with ``torch.load(weights_only=True)``;
    - a distributed checkpoint directory (``ModelParallelStrategy`` / ``MoEParallelStrategy``): the
      torch.distributed.checkpoint shards of every rank (keys ``state_dict.model.*``, ``optimizer_0.*``) plus
      Lightning's ``meta.pt`` (hyper-parameters, loops, ...), resharded to full tensors by DCP.

    The config comes from the checkpoint's ``hyper_parameters["config"]``. Where the optimizer state holds fp32 master
    weights (``MoELanguageModel(master_dtype="fp32")``) they are read instead of the (bf16) parameters. ``dtype`` None
    keeps the dtype of the weights read (fp32 with masters); routers stay fp32 either way. Nothing in the files is
    executed."""
    path = resolve(os.path.expanduser(str(ckpt_path)))
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    if path.is_dir():
        config, model, stored_dtype = _load_distributed_dir(path, device)
    else:
        config, state = _load_lightning_file(path)
        stored_dtype = _checkpoint_dtype([v.dtype for v in state.values()])
        model = _build_empty(config, device)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{path} does not match its own config: {' '.join(str(err).split())[:400]}") from err
    model.to(dtype or stored_dtype)  # routers keep fp32 (TopKRouter._apply)
    model.eval().requires_grad_(False)
    return model, config
