"""Low-precision training: FP8 / MXFP8 / NVFP4 recipes and the block-scaled formats they use."""
