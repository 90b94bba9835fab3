"""Regional compilation: the chosen modules are compiled in place, state-dict keys and numbers unchanged.

torch.compile stays off on CPU in the other tests; here dynamo traces with the "eager" backend (no code generation),
which exercises the region selection and tracing of our modules without a compiler."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe.config import resolve_model_config
from lightning_moe.models.transformer import MoETransformer
from lightning_moe.parallel.compile import COMPILE_REGIONS, apply_compile, resolve_compile


def _model(**over):
    cfg = resolve_model_config({"preset": "tiny", **over})
    torch.manual_seed(0)
    m = MoETransformer(cfg)
    m.init_weights()
    return m


def test_resolve_compile():
    assert resolve_compile(True) == COMPILE_REGIONS
    assert resolve_compile(False) == () and resolve_compile(None) == () and resolve_compile("none") == ()
    assert resolve_compile("norm, router") == ("norm", "router")
    assert resolve_compile(["attention", "attention"]) == ("attention",)
    with pytest.raises(ValueError, match="unknown: \\['experts'\\]"):
        resolve_compile(["norm", "experts"])


def test_compiled_regions_match_eager():
    torch._dynamo.reset()
    ref = _model()
    comp = copy.deepcopy(ref)
    n = apply_compile(comp, True, backend="eager")
    # every block: two norms, attention, router (no shared experts in tiny); the final norm; qk-norms if any
    assert n >= 4 * ref.config.num_layers + 1
    assert list(comp.state_dict()) == list(ref.state_dict())
    ids = torch.randint(0, ref.config.vocab_size, (2, 16))
    labels = ids.roll(-1, 1)
    outs = []
    for m in (ref, comp):
        out = m(ids, labels_BS=labels)
        (out.loss_sum + out.aux_loss + out.z_loss).backward()
        outs.append(out)
    for (name, p), q in zip(ref.named_parameters(), comp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    # the step output's routing records are the same, compiled or not: one per MoE layer and forward
    assert sorted(outs[0].moe) == sorted(outs[1].moe) == [int(i) for i, b in ref.layers.items() if b.is_moe]
    for i in outs[0].moe:
        assert torch.equal(outs[0].moe[i].routing.tokens_per_expert, outs[1].moe[i].routing.tokens_per_expert)
        torch.testing.assert_close(outs[1].moe[i].aux_loss, outs[0].moe[i].aux_loss)
