"""Low-precision numerics (FP8, MXFP8, NVFP4): quantizers, emulated and kernel-backed GEMMs."""
