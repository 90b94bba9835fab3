"""The public classes' on/off options take True or False only (``lightning_moe.flags.check_flags``)."""

from __future__ import annotations

import pytest

import lightning_moe
import lightning_moe.callbacks
import lightning_moe.data
from lightning_moe.flags import check_flags


def test_check_flags_names_every_option_that_is_not_a_bool():
    check_flags("X", a=True, b=False)
    with pytest.raises(ValueError, match=r"^X: a='false', c=1 must be True or False$"):
        check_flags("X", a="false", b=True, c=1)


@pytest.mark.parametrize("owner, kwargs", [
    ("MoEParallelStrategy", {"async_save": "false"}),
    ("MoEParallelStrategy", {"save_distributed_checkpoint": "False", "free_grads_after_step": 0}),
    ("MoELanguageModel", {"skip_empty_steps": "no"}),
    ("MoELanguageModel", {"fused": "true"}),
    ("TextDataModule", {"document_mask": "false"}),
    ("ActivationOffload", {"prefetch": None}),
    ("LoadBalanceMonitor", {"heatmap": "off"}),
])
def test_on_off_options_take_true_or_false_only(owner, kwargs):
    """``bool("false")`` is True: a string would silently turn the option on, so it is refused, naming it."""
    cls = next(getattr(m, owner) for m in (lightning_moe, lightning_moe.callbacks, lightning_moe.data)
               if hasattr(m, owner))
    with pytest.raises(ValueError, match=f"{owner}: {next(iter(kwargs))}=.* must be True or False"):
        cls(**kwargs)
    assert cls(**{k: False for k in kwargs}) is not None  # the bools themselves pass
