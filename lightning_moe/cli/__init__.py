"""The command line, ``lightning-moe <command>``: the LightningCLI (:mod:`~lightning_moe.cli.main`), ``plan``
(:mod:`~lightning_moe.cli.plan`), the meaning of its values (:mod:`~lightning_moe.cli.values`) and their
composition before parsing (:mod:`~lightning_moe.cli.argv`), ``--ckpt_path`` (:mod:`~lightning_moe.cli.resume`)
and its one-line errors (:mod:`~lightning_moe.cli.errors`, :mod:`~lightning_moe.cli.explain`)."""

from lightning_moe.checkpoint.find import newest_checkpoint
from lightning_moe.cli.errors import PROG, MoEArgumentParser, UsageError
from lightning_moe.cli.main import MoECLI, generate_command, main
from lightning_moe.cli.plan import plan_main
from lightning_moe.cli.values import STRATEGY_NAMES

__all__ = ["PROG", "STRATEGY_NAMES", "MoEArgumentParser", "MoECLI", "UsageError", "generate_command", "main",
           "newest_checkpoint", "plan_main"]
