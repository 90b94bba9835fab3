"""``python -m bench``: the one runner of the benchmark suites (see bench/README.md).

    python -m bench --list                      the suites
    python -m bench <suite> [options]           run one (``python -m bench <suite> --help``)
    python -m bench results [--check]           regenerate bench/RESULTS.md's tables from the result files
"""

from __future__ import annotations

import sys
from typing import Optional

from bench.core.env import apply_policy
from bench.suites import SUITES, load


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--list":
        width = max(map(len, SUITES))
        print("\n".join(f"{name.ljust(width)}  {what}" for name, what in SUITES.items()))
        return 0
    if argv[0] == "results":
        from bench import report

        return report.main(argv[1:])
    apply_policy()  # before the suite imports torch: children and process groups inherit it
    try:
        return load(argv[0]).main(argv[1:])
    except ValueError as e:  # a user error: its message, exit 2 (argparse's convention), no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from bench.core.exit import run_then_exit

    run_then_exit(main)  # sys.exit(main()); under torchrun flushed, then os._exit (bench/core/exit.py says why)
