"""The on/off options of the public classes take True or False only: ``bool("false")`` is True, so a string such as
``async_save="false"`` (a value read from a file or the environment) would silently turn the option on."""

from __future__ import annotations

__all__ = ["check_flags"]


def check_flags(owner: str, **flags: object) -> None:
    """A ValueError naming every one of ``owner``'s ``flags`` that is not a bool."""
    bad = {k: v for k, v in flags.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"{owner}: {', '.join(f'{k}={v!r}' for k, v in bad.items())} must be True or False")
