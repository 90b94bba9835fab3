"""Command line: ``lightning-moe fit --config ...`` (LightningCLI) and ``lightning-moe plan --preset NAME``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from lightning.pytorch.cli import LightningCLI

from lightning_moe.config import ModelConfig, preset_names
from lightning_moe.data import TextDataModule
from lightning_moe.module import MoELanguageModel
from lightning_moe.plan import PRECISION_BYTES, format_plan


class MoECLI(LightningCLI):
    """LightningCLI over MoELanguageModel and TextDataModule, checking that data and model agree."""

    def before_fit(self) -> None:
        model, dm = self.model, self.datamodule
        vocab = getattr(dm, "vocab_size", None)
        if vocab is not None and vocab > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but model vocab_size is {model.config.vocab_size}: "
                f"set model.config.vocab_size >= {vocab}"
            )
        seq_len = getattr(dm, "seq_len", None)
        if seq_len is not None and seq_len > model.config.max_seq_len:
            raise ValueError(
                f"data.seq_len={seq_len} exceeds model max_seq_len={model.config.max_seq_len}: lower seq_len or "
                "raise max_seq_len"
            )


def plan_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lightning-moe plan", description="Parameter and memory plan for a preset.")
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(preset_names())}")
    p.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISION_BYTES))
    args = p.parse_args(argv)
    try:
        cfg = ModelConfig.from_preset(args.preset)
    except ValueError as e:
        p.error(str(e))
    print(format_plan(args.preset, cfg, args.precision))
    return 0


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plan":
        sys.exit(plan_main(argv[1:]))
    MoECLI(
        MoELanguageModel,
        TextDataModule,
        args=argv,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
