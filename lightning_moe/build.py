"""The one build pipeline (DESIGN invariant 11):

    build on meta -> model transforms -> parallelize -> materialise -> initialise or load

1. **build on meta**: ``MoETransformer(config)`` under ``torch.device("meta")``: no memory, whatever the size.
   Component classes come from the config through :mod:`lightning_moe.models.registry`.
2. **model transforms**: callables ``fn(model) -> model | None`` that swap or wrap modules of the meta model
   (low-precision linears, offload wrappers, the precision plugin's ``convert_module``). They come from
   ``MoELanguageModel(model_transforms=[...])`` and from every Trainer callback that defines
   ``transform_model(model)`` (see :class:`ModelTransform`), in that order, then the strategy's own.
3. **parallelize**: the strategy attaches its layout (DTensor placements, dispatchers, FSDP2) to the meta model.
4. **materialise**: ``to_empty(device=...)`` allocates only what this rank holds.
5. **initialise or load**: ``initialize(model)`` fills the weights (seeded init, or weights from a checkpoint or a
   Hugging Face folder).

``MoELanguageModel.configure_model`` runs it under every strategy; it can also be called directly.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import nn

from lightning_moe.config import ModelConfig
from lightning_moe.models.transformer import MoETransformer

__all__ = ["ModelTransform", "build_model"]

Transform = Callable[[nn.Module], Optional[nn.Module]]


@runtime_checkable
class ModelTransform(Protocol):
    """A Trainer callback that changes the model before parallelisation: ``transform_model`` gets the meta-device
    :class:`~lightning_moe.models.transformer.MoETransformer` and returns it (or a replacement, or None for "changed
    in place"). It must keep state-dict keys and global shapes (DESIGN invariant 3)."""

    def transform_model(self, model: nn.Module) -> Optional[nn.Module]: ...


def build_model(
    config: ModelConfig,
    *,
    transforms: Sequence[Transform] = (),
    parallelize: Optional[Callable[[nn.Module], nn.Module]] = None,
    device: Union[str, torch.device] = "cpu",
    initialize: Optional[Callable[[nn.Module], None]] = None,
) -> MoETransformer:
    """Run the pipeline of the module docstring and return the materialised, initialised model.

    ``initialize`` None = ``model.init_weights()`` with the current RNG state.
    """
    with torch.device("meta"):
        model: nn.Module = MoETransformer(config)
    for fn in transforms:
        out = fn(model)
        model = model if out is None else out
    if not isinstance(model, MoETransformer):
        raise ValueError(f"a model transform returned {type(model).__name__}; transforms must return the "
                         "MoETransformer they were given (changed in place) or None")
    if parallelize is not None:
        model = parallelize(model)
    model.to_empty(device=device)
    if initialize is None:
        with torch.no_grad():
            model.init_weights()
    else:
        initialize(model)
    return model
