"""Our label convention (pre-shifted labels, -100 ignored): the shift of a batch's inputs, padding and packed
documents' boundaries masked."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_moe.models.lm_loss import IGNORE_INDEX


def shift_labels(input_ids_BS: Tensor, attention_mask_BS: Optional[Tensor] = None,
                 position_ids_BS: Optional[Tensor] = None) -> Tensor:
    """Our label convention: labels are the inputs shifted left by one (``labels[t]`` is the token after
    ``input_ids[t]``); the last position, padding and, for packed documents, each document's last token are -100."""
    labels = torch.full_like(input_ids_BS, IGNORE_INDEX)
    labels[:, :-1] = input_ids_BS[:, 1:]
    if attention_mask_BS is not None:
        labels[:, :-1] = labels[:, :-1].masked_fill(attention_mask_BS[:, 1:] == 0, IGNORE_INDEX)
    return mask_document_ends(labels, position_ids_BS)


def mask_document_ends(labels_BS: Tensor, position_ids_BS: Optional[Tensor]) -> Tensor:
    """Packed documents: -100 wherever the next token starts a document (position 0), so no label predicts
    across a boundary."""
    if position_ids_BS is None:
        return labels_BS
    labels_BS = labels_BS.clone()
    labels_BS[:, :-1] = labels_BS[:, :-1].masked_fill(position_ids_BS[:, 1:] == 0, IGNORE_INDEX)
    return labels_BS
