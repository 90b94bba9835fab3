"""Low-precision numerics (FP8, MXFP8, NVFP4): quantizers, emulated and kernel-backed GEMMs."""

import logging


class _DropImportNoise(logging.Filter):
    """Lines that importing torchao writes and that say nothing about the run: "Failed to load .../_C_*.so" for each
    prebuilt kernel library that does not match this machine (kernels of other GPU architectures, a CPU-only torch;
    a recipe that needs a missing kernel is refused by ``check_hardware`` with the fix, DESIGN invariant 7), and
    torch >= 2.13's deprecation note about torchao registering its enums with the pytree."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.getMessage())
        return not (text.startswith("Failed to load ") or "is an Enum subclass and is now natively supported" in text)


def quiet_torchao_import() -> None:
    for name in ("torchao", "torch.utils._pytree"):  # their module loggers; filters apply before torchao is imported
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNoise) for f in logger.filters):
            logger.addFilter(_DropImportNoise())


quiet_torchao_import()
