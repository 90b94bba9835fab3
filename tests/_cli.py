"""In-process CLI runs for the tests."""

import sys

from lightning_moe.cli import main


def run_cli(argv):
    """main(argv) -> exit code (0 for a normal return). sys.argv is pytest's own: hide it from LightningCLI."""
    saved = sys.argv
    sys.argv = ["lightning-moe"]
    try:
        main(argv)
    except SystemExit as e:
        return 0 if e.code is None else e.code
    finally:
        sys.argv = saved
    return 0
