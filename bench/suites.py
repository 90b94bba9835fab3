"""The suites the runner knows: name -> module ``bench.<name>`` (with ``main(argv) -> int``) and one line on what it
measures. Multi-rank suites run under torchrun: ``torchrun --nproc-per-node 2 -m bench scale ...``."""

from __future__ import annotations

import importlib
from types import ModuleType

SUITES: dict[str, str] = {
    "train_step": "full training step of the 8-layer Qwen3-30B-A3B-shaped model vs transformers (tokens/s, MFU)",
    "moe_layer": "MoE layer forward + backward vs the bare grouped GEMM, transformers and torchtitan",
    "precision_step": "bf16 compute with fp32 master state: speed, memory, the optimizer step against its bound",
    "precision_seeds": "seed study of the precision modes (convergence of bf16 with fp32 master state)",
    "deepseek_v3_step": "DeepSeek-V3-shaped training step vs transformers' DeepseekV3ForCausalLM",
    "memory": "selective recomputation and activation offload: activation memory and step time",
    "low_precision": "FP8 / NVFP4 training: layer and step speed, convergence of every recipe",
    "fp8_crossover": "FP8 vs bf16 GEMM (quantization included) per shape and M: the crossover table recipe='auto' reads",
    "fp8_linear": "eager dense FP8 linear: kernels vs emulation, speed vs bf16 and torchao's Float8Linear",
    "doc_mask": "document-masked attention vs full causal attention in a training step",
    "checkpoint": "checkpoint save / resume: save stall, load time, the resumed run continues (torchrun)",
    "kernels_check": "fused MoE kernels against the PyTorch reference: correctness and speed",
    "monitor_overhead": "step-time overhead of LoadBalanceMonitor",
    "saved_tensors": "the bytes autograd saves for the backward, by producing op",
    "scale": "multi-GPU scaling of the layouts vs one GPU and transformers + FSDP2 (torchrun)",
    "parallel_check": "a layout trains like one GPU on the same global batch (torchrun)",
    "deepep_check": "DeepEP dispatcher against the all-to-all dispatcher on 2 GPUs (torchrun)",
}


def load(name: str) -> ModuleType:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; `python -m bench --list` lists: {', '.join(SUITES)}")
    return importlib.import_module(f"bench.{name}")
