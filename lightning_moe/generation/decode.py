"""The decode loop: KV-cached (or recomputed) generation from token ids, and from strings through a tokenizer.

Generation is single-process and dropless: while it runs, routers ignore ``capacity_factor`` so that a token's
output never depends on what else is in the batch (the cached and uncached paths then agree exactly), the model is
in eval mode (no expert-bias counts), and the MoE layers' last losses and statistics are restored afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_moe.config import ModelConfig
from lightning_moe.generation.sampling import _check_sampling, sample_next_token
from lightning_moe.models.transformer import KVCache, MoETransformer


@contextlib.contextmanager
def _inference_state(model: MoETransformer) -> Iterator[None]:
    """Eval mode and dropless routing, for the duration."""
    was_training = model.training
    saved = []
    for layer in model.moe_layers():
        router_cfg = layer.router.config
        saved.append((layer, router_cfg))
        if router_cfg.capacity_factor is not None:
            layer.router.config = dataclasses.replace(router_cfg, capacity_factor=None, pad_to_capacity=False)
    model.eval()
    try:
        yield
    finally:
        for layer, router_cfg in saved:
            layer.router.config = router_cfg
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
