"""The step protocol stays explicit (issue 21 item 1, DESIGN invariant 13): no per-forward state on the MoE layers,
no side channel from the module to the monitor, and a gradient finalisation that knows no LightningModule and reads
no router attribute. Checked on the source, so a later change cannot bring a side channel back unnoticed."""

from __future__ import annotations

import ast
import re

from test_import_graph import PACKAGE, import_graph

# attributes the typed records replaced (MoERecorder / LMStepOutput / StepAccumulator / step_result)
BANNED_NAMES = ("last_aux_loss", "last_z_loss", "last_stats", "_routing_stats", "pop_routing_stats", "last_step",
                "bias_counts", "moe_losses")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_side_channel_attribute_is_left():
    hits = [f"{path}:{i + 1}: {line.strip()}" for path, text in _sources().items()
            for i, line in enumerate(text.splitlines()) for name in BANNED_NAMES
            if re.search(rf"\b{re.escape(name)}\b", line)]
    assert not hits, "side-channel names are back:\n" + "\n".join(hits)


def test_finalisation_knows_no_module_and_reads_no_router():
    graph = import_graph(PACKAGE)
    deps = graph["lightning_moe.parallel.finalize"]
    # (lightning_moe.collectives: the functional collectives, settled on CPU; it knows no module either)
    allowed = {"lightning_moe.moe.record", "lightning_moe.parallel.grads", "lightning_moe.step",
               "lightning_moe.collectives"}
    assert deps <= allowed, deps - allowed  # no module.py, no strategy, no model or router class
    tree = ast.parse((PACKAGE / "parallel" / "finalize.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for banned in ("lightning", "LightningModule", "router", "trainer", "model", "moe"):
        assert banned not in names | attrs, banned
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {(n.module or "").split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom)}
    assert "lightning" not in imported


def test_the_strategy_does_not_reach_into_the_module_to_finalise():
    text = (PACKAGE / "strategies" / "moe_parallel.py").read_text()
    for banned in ("on_step_finalized", "step_accumulator", "step_result", "finalize_module_step"):
        assert banned not in text, banned


def test_the_strategy_reads_the_module_through_its_one_seam():
    """What the strategy needs of the module comes from module.parallel_requirements() (strategies/requirements.py):
    no module attribute (config, master_dtype, model) is read in moe_parallel.py."""
    text = (PACKAGE / "strategies" / "moe_parallel.py").read_text()
    pattern = re.compile(r"\b(lightning_module|module)\.(config|master_dtype|model)\b|"
                         r"getattr\((self\.lightning_module|module), \"(config|master_dtype|model)\"")
    hits = [line.strip() for line in text.splitlines() if pattern.search(line)]
    assert not hits, hits
    assert pattern.search('getattr(self.lightning_module, "master_dtype", None)')


def test_no_signature_probe_in_the_moe_package():
    hits = [path for path, text in _sources().items()
            if path.startswith("lightning_moe/moe/") and re.search(r"\binspect\.signature\b|from inspect import", text)]
    assert hits == [], hits


def test_recompute_and_offload_replace_no_method():
    """The activation plans are read at the seams (lightning_moe/activation_plan.py): no method is assigned over,
    no wrapper protocol, no module wrapper around blocks."""
    pattern = re.compile(r"\brecompute_inside\b|\bcheckpoint_wrapper\b|\.(forward|act_down|up_proj|kernel|"
                         r"core_attention_call)\s*=[^=]|setattr\([^)]*[\"'](forward|act_down|up_proj|kernel)[\"']")
    hits = [f"{path}:{i + 1}: {line.strip()}" for path, text in _sources().items()
            for i, line in enumerate(text.splitlines()) if pattern.search(line)]
    assert not hits, "\n".join(hits)
    assert pattern.search("m.forward = _Scoped(m.forward)") and pattern.search('setattr(obj, "act_down", f)')


def test_the_rule_finds_a_side_channel(tmp_path):
    """The name search is a word match: it flags the attribute, not names that merely contain it."""
    line = "self.last_step = result"
    assert any(re.search(rf"\b{re.escape(n)}\b", line) for n in BANNED_NAMES)
    assert not any(re.search(rf"\b{re.escape(n)}\b", "self._prev_step_time = t") for n in BANNED_NAMES)


def _unfinalised_step(rank: int, world_size: int) -> str:
    import lightning as L

    from lightning_moe import MoELanguageModel, MoEParallelStrategy
    from parallel_harness import FixedData, small_config

    class NoSuper(MoELanguageModel):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            optimizer.step(closure=optimizer_closure)  # skips the module's finalisation

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEParallelStrategy(), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    try:
        trainer.fit(NoSuper(small_config(), warmup_steps=0), datamodule=FixedData(2, 4))
    except RuntimeError as e:
        return str(e)
    return "trained"


def test_the_strategy_refuses_a_step_that_was_not_finalised():
    """The finalisation is the module's call (through the strategy's one hook): a module whose optimizer_step skips
    it would step on unnormalised gradients and a stale expert bias; the strategy stops it with the fix named."""
    from _dist import run_distributed

    msg = run_distributed(_unfinalised_step, 1)
    assert "without gradient finalisation" in msg and "super().optimizer_step" in msg, msg
