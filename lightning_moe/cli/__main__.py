"""``python -m lightning_moe.cli ...``: the same command as the ``lightning-moe`` console script."""

from lightning_moe.cli.main import main

if __name__ == "__main__":
    main()
