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
    for m in (ref, comp):
        m(ids, labels_BS=labels).backward()
    for (name, p), q in zip(ref.named_parameters(), comp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    # routing statistics are recorded once per forward, compiled or not
    for a, b in zip(ref.moe_layers(), comp.moe_layers()):
        assert torch.equal(a.pop_routing_stats().tokens_per_expert, b.pop_routing_stats().tokens_per_expert)
