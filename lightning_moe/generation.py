"""Text generation from a trained MoETransformer: KV-cached greedy / temperature / top-k / top-p sampling, loading a
model from a checkpoint of any layout in one process, and the ``lightning-moe generate`` entry point.

- :func:`generate`: token ids in, prompt + continuation ids out (left-padded batches through ``attention_mask``).
- :func:`generate_text`: strings in, continuations out (for ``predict``-style use).
- :func:`load_for_generation`: a Lightning ``.ckpt`` file or a distributed (DCP) checkpoint directory written by
  ``ModelParallelStrategy`` / ``MoEParallelStrategy``, read without a process group; never runs code from the files.
- :func:`generate_main`: the command line (``lightning-moe generate --ckpt_path ... --prompt ...``).

Generation is single-process and dropless: while it runs, routers ignore ``capacity_factor`` so that a token's
output never depends on what else is in the batch (the cached and uncached paths then agree exactly), the model is
in eval mode (no expert-bias counts), and the MoE layers' last losses and statistics are restored afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_moe.checkpoint.format import DCP_METADATA_FILE as _DCP_METADATA
from lightning_moe.checkpoint.format import META_FILE as _LIGHTNING_META
from lightning_moe.checkpoint.find import LAST, resolve_checkpoint_arg
from lightning_moe.checkpoint.publish import resolve
from lightning_moe.config import ModelConfig, resolve_model_config
from lightning_moe.models.transformer import KVCache, MoETransformer

__all__ = ["generate", "generate_text", "generate_any", "load_for_generation", "checkpoint_tokenizer", "generate_main",
           "sample_next_token"]


# ---- sampling -------------------------------------------------------------------------------------------------------


def _check_sampling(temperature: float, top_p: float, top_k: Optional[int]) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")


def sample_next_token(logits_BV: Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: Optional[int] = None,
                      generator: Optional[torch.Generator] = None) -> Tensor:
    """Next token ids [B] from logits [B, V]: argmax when ``temperature == 0``; otherwise sample from
    softmax(logits / temperature) restricted to the ``top_k`` most likely tokens and to the smallest set of most
    likely tokens whose probability reaches ``top_p`` (nucleus; the most likely token always stays)."""
    _check_sampling(temperature, top_p, top_k)
    logits_BV = logits_BV.float()
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_BV = (probs_BV.cumsum(dim=-1) - probs_BV) >= top_p
        drop_BV[:, 0] = False
        logits_BV = logits_BV.masked_fill(drop_BV.scatter(1, order_BV, drop_BV), float("-inf"))
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)


# ---- generation -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _inference_state(model: MoETransformer) -> Iterator[None]:
    """Eval mode, dropless routing, and the MoE layers' last losses/stats untouched, for the duration."""
    was_training = model.training
    saved = []
    for layer in model.moe_layers():
        router_cfg = layer.router.config
        saved.append((layer, router_cfg, layer.last_aux_loss, layer.last_z_loss, layer.last_stats))
        if router_cfg.capacity_factor is not None:
            layer.router.config = dataclasses.replace(router_cfg, capacity_factor=None, pad_to_capacity=False)
    model.eval()
    try:
        yield
    finally:
        for layer, router_cfg, aux, z, stats in saved:
            layer.router.config = router_cfg
            layer.last_aux_loss, layer.last_z_loss, layer.last_stats = aux, z, stats
        model.train(was_training)


def _positions(mask_BS: Tensor) -> Tensor:
    """Per-sequence positions of a left-padded batch: the number of earlier real tokens (padding: 0)."""
    return (mask_BS.long().cumsum(1) - 1).clamp(min=0)


def generate(
    model: MoETransformer,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: Optional[int] = None,
    eos_token_id: Optional[int] = None,
    attention_mask: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    pad_token_id: Optional[int] = None,
    use_cache: bool = True,
) -> Tensor:
    """Continue ``input_ids`` [B, S] (or [S]) by up to ``max_new_tokens`` tokens; return prompt + continuation,
    [B, S + n] (or [S + n]), n <= max_new_tokens (fewer when every sequence has stopped).

    A batch of prompts of different lengths is left-padded, with ``attention_mask`` [B, S] (1 = real token,
    0 = padding; padding ids are ignored). Each sequence is generated exactly as it would be alone.
    A sequence stops after producing ``eos_token_id`` (kept in the output); its later slots hold
    ``pad_token_id`` (default: ``eos_token_id``). ``temperature == 0`` is greedy decoding; otherwise tokens are
    sampled (see :func:`sample_next_token`) with ``generator`` (on the model's device) for reproducibility.
    ``use_cache=False`` recomputes the whole sequence at every step (the reference for the cached path).

    Runs under ``torch.inference_mode()`` on the model's device, in eval mode and dropless (see the module
    docstring); the model's training mode is restored afterwards.
    """
    with torch.inference_mode():
        return _generate(model, input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, eos_token_id=eos_token_id, attention_mask=attention_mask, generator=generator,
                         pad_token_id=pad_token_id, use_cache=use_cache)


def _generate(model: MoETransformer, input_ids: Tensor, *, max_new_tokens: int, temperature: float, top_p: float,
              top_k: Optional[int], eos_token_id: Optional[int], attention_mask: Optional[Tensor],
              generator: Optional[torch.Generator], pad_token_id: Optional[int], use_cache: bool) -> Tensor:
    cfg: ModelConfig = model.config
    V = cfg.vocab_size
    if not isinstance(input_ids, Tensor):
        raise ValueError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    squeeze = input_ids.dim() == 1
    if squeeze:
        input_ids = input_ids[None]
        attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids of shape [B, S] or [S], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if B == 0 or S == 0:
        raise ValueError(f"input_ids must hold at least one prompt of at least one token, got shape {(B, S)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if S + max_new_tokens > cfg.max_seq_len:
        fixes = [f"ask for at most {cfg.max_seq_len - S} new tokens"] if S < cfg.max_seq_len else []
        if max_new_tokens < cfg.max_seq_len:
            fixes.insert(0, f"shorten the prompt to at most {cfg.max_seq_len - max_new_tokens} tokens")
        raise ValueError(
            f"the prompt ({S} tokens) plus max_new_tokens={max_new_tokens} exceeds the model's max_seq_len="
            f"{cfg.max_seq_len}: " + (" or ".join(fixes) if fixes else
                                      f"keep prompt + new tokens within {cfg.max_seq_len}")
        )
    _check_sampling(temperature, top_p, top_k)
    for name, tok in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if tok is not None and (isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < V):
            raise ValueError(f"{name} must be a token id in [0, {V}), got {tok!r}")
    device = model.tok_embeddings.weight.device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        mask_BS = torch.ones(B, S, dtype=torch.bool, device=device)
    else:
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"attention_mask must have the shape of input_ids {(B, S)}, got "
                             f"{tuple(attention_mask.shape)}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
        mask_BS = attention_mask.to(device=device, dtype=torch.bool)
        if not bool(mask_BS[:, -1].all()) or bool((mask_BS[:, 1:] < mask_BS[:, :-1]).any()):
            raise ValueError("attention_mask must describe left padding (each row: zeros, then at least one one, "
                             "up to the last position); pad prompts of different lengths on the left")
    real_ids = input_ids[mask_BS]
    if real_ids.numel() and (int(real_ids.min()) < 0 or int(real_ids.max()) >= V):
        raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {V}): "
                         f"min {int(real_ids.min())}, max {int(real_ids.max())}")
    ids_BS = input_ids.masked_fill(~mask_BS, 0).long()
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)

    out = [input_ids.long()]
    finished_B = torch.zeros(B, dtype=torch.bool, device=device)
    with _inference_state(model):
        cache = KVCache(B, S + max_new_tokens, device=device) if use_cache and max_new_tokens > 0 else None
        step_ids, step_mask = ids_BS, (None if bool(mask_BS.all()) else mask_BS)
        seq_ids, seq_mask = ids_BS, mask_BS
        for _ in range(max_new_tokens):
            if cache is not None:
                h_BSD = model.hidden_states(step_ids, step_mask, cache=cache)
            else:
                h_BSD = model.hidden_states(seq_ids, None if bool(seq_mask.all()) else seq_mask, _positions(seq_mask))
            logits_BV = model.logits(h_BSD[:, -1])
            next_B = sample_next_token(logits_BV, temperature, top_p, top_k, generator)
            next_B = torch.where(finished_B, torch.full_like(next_B, pad), next_B)
            out.append(next_B[:, None])
            if eos_token_id is not None:
                finished_B |= next_B == eos_token_id
                if bool(finished_B.all()):
                    break
            step_ids, step_mask = next_B[:, None], None
            if cache is None:
                seq_ids = torch.cat([seq_ids, next_B[:, None]], dim=1)
                seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], dim=1)
    result = torch.cat(out, dim=1)
    return result[0] if squeeze else result


# ---- tokenizers -----------------------------------------------------------------------------------------------------


def _is_byte_tokenizer(tokenizer: Any) -> bool:
    from lightning_moe.data.tokenizer import ByteTokenizer

    return isinstance(tokenizer, ByteTokenizer)


def _encode(tokenizer: Any, text: str) -> list[int]:
    if _is_byte_tokenizer(tokenizer):
        return tokenizer.encode(text)
    return list(tokenizer.encode(text, add_special_tokens=False))  # Hugging Face


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if _is_byte_tokenizer(tokenizer):
        return tokenizer.decode(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


def _eos_id(tokenizer: Any) -> Optional[int]:
    for attr in ("eos_id", "eos_token_id", "sep_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return None


def generate_text(model: MoETransformer, tokenizer: Any, prompts: Sequence[str], **kw: Any) -> list[str]:
    """Continuations (without the prompts) of ``prompts``, generated in one left-padded batch. ``tokenizer``: a
    :class:`~lightning_moe.data.tokenizer.ByteTokenizer` or a Hugging Face tokenizer; prompts are encoded without
    special tokens, generation stops at the tokenizer's EOS unless ``eos_token_id`` is given; other keywords go to
    :func:`generate` (``max_new_tokens`` is required)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        return []
    encoded = [_encode(tokenizer, p) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise ValueError("every prompt must encode to at least one token (got an empty prompt)")
    width = max(len(e) for e in encoded)
    ids = torch.zeros(len(encoded), width, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e):] = 1
    kw.setdefault("eos_token_id", _eos_id(tokenizer))
    out = generate(model, ids, attention_mask=mask, **kw)
    eos = kw["eos_token_id"]
    texts = []
    for row in out[:, width:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        texts.append(_decode(tokenizer, row))
    return texts


def generate_any(model: MoETransformer, prompt_or_ids: Union[str, Sequence[str], Tensor], *,
                 max_new_tokens: int = 64, tokenizer: Any = None, **kw: Any) -> Union[str, list[str], Tensor]:
    """What ``MoELanguageModel.generate`` does: a string -> its continuation (str), a list of strings -> their
    continuations, token ids (tensor [B, S] or [S]) -> prompt + continuation ids (see :func:`generate`). Strings use
    ``tokenizer`` (default: the byte tokenizer) and stop at its EOS."""
    if isinstance(prompt_or_ids, str) or (
        isinstance(prompt_or_ids, (list, tuple)) and all(isinstance(p, str) for p in prompt_or_ids)
    ):
        if tokenizer is None:
            from lightning_moe.data.tokenizer import ByteTokenizer

            tokenizer = ByteTokenizer()
        texts = generate_text(model, tokenizer, prompt_or_ids, max_new_tokens=max_new_tokens, **kw)
        return texts[0] if isinstance(prompt_or_ids, str) else texts
    if not isinstance(prompt_or_ids, Tensor):
        raise ValueError(f"prompt_or_ids must be a string, a list of strings or a tensor of token ids, got "
                         f"{type(prompt_or_ids).__name__}")
    return generate(model, prompt_or_ids, max_new_tokens=max_new_tokens, **kw)


# ---- loading --------------------------------------------------------------------------------------------------------


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


# ---- command line ---------------------------------------------------------------------------------------------------


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line and exit code 2, instead of argparse's usage dump and exit
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lightning-moe generate",
        description="Continue prompts with a trained lightning_moe model (any checkpoint layout, one process).",
    )
    p.add_argument("--ckpt_path", required=True, help="a Lightning .ckpt file or a distributed checkpoint directory; "
                   "`last`: the newest checkpoint under --default_root_dir")
    p.add_argument("--default_root_dir", default=None,
                   help="with --ckpt_path last: the run's folder (default: the current directory), as "
                   "--trainer.default_root_dir of `lightning-moe test`")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch of prompts")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--tokenizer", default=None,
                   help="a local Hugging Face tokenizer directory (default: the built-in byte tokenizer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="default: the checkpoint's")
    return p


def generate_main(argv: Optional[list[str]] = None) -> int:
    """``lightning-moe generate``: prints, for each prompt, the prompt followed by its continuation (a blank line
    between prompts). Bad paths or arguments print one line to stderr and return 2."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.max_new_tokens < 0:
            raise ValueError(f"--max_new_tokens must be >= 0, got {args.max_new_tokens}")
        _check_sampling(args.temperature, args.top_p, args.top_k)
        try:
            device = torch.device(args.device)
        except RuntimeError as err:
            raise ValueError(f"--device {args.device!r}: {err}") from None
        ckpt_path = resolve_checkpoint_arg(args.ckpt_path, args.default_root_dir, "--ckpt_path")
        if args.ckpt_path == LAST:
            print(f"lightning-moe generate: --ckpt_path last -> {ckpt_path}", file=sys.stderr)
        name = args.tokenizer
        if name is None and (name := checkpoint_tokenizer(ckpt_path)) is not None:
            if not os.path.isdir(os.path.expanduser(name)):
                raise ValueError(f"{args.ckpt_path} was trained with the tokenizer {name!r}, which is not there: give "
                                 "--tokenizer DIR (a copy of that tokenizer)")
            print(f"lightning-moe generate: the checkpoint's tokenizer: {name}", file=sys.stderr)
        if name is None:
            from lightning_moe.data.tokenizer import ByteTokenizer

            tokenizer: Any = ByteTokenizer()
        else:
            from lightning_moe.data.tokenizer import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(name)
        model, config = load_for_generation(ckpt_path, device=device, dtype=_DTYPES.get(args.dtype))
        if name is None and config.vocab_size != len(tokenizer):
            print(f"lightning-moe generate: warning: the model has {config.vocab_size} tokens, the byte tokenizer "
                  f"{len(tokenizer)}, and the checkpoint names no tokenizer: give --tokenizer DIR", file=sys.stderr)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        texts = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, generator=generator)
    except (_ArgError, ValueError, FileNotFoundError, ImportError) as err:
        print(f"lightning-moe generate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    for i, (prompt, text) in enumerate(zip(args.prompt, texts)):
        if i:
            print()
        print(prompt + text)
    return 0
