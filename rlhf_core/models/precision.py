"""How a rank computes, decided before it starts: bf16 on a CPU is autocast around forward passes when the CPU has
bf16 (else fp32, one warning); fp16 needs a GPU; on a GPU DeepSpeed's own bf16/fp16."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.errors import UserError
from rlhf_core.notices import warn_once


@dataclass(frozen=True)
class Precision:
    """How one rank computes: DeepSpeed's own bf16/fp16 (GPU), bf16 autocast (CPU), or plain fp32."""

    deepspeed_bf16: bool = False
    deepspeed_fp16: bool = False
    cpu_autocast_bf16: bool = False


def cpu_supports_bf16() -> bool:
    """oneDNN's own check for native bf16 (avx512_bf16 / AMX); /proc/cpuinfo where torch cannot tell."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                flags = cpuinfo.read()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(param_dtype: str, on_gpu: bool, cpu_bf16: bool | None = None) -> Precision:
    if on_gpu:
        return Precision(deepspeed_bf16=param_dtype == "bf16", deepspeed_fp16=param_dtype == "fp16")
    if param_dtype == "fp16":
        raise UserError("--param_dtype fp16 needs a GPU (fp16 training on a CPU is not supported); use "
                        "--param_dtype bf16 or fp32.")
    if param_dtype == "bf16":
        if cpu_supports_bf16() if cpu_bf16 is None else cpu_bf16:
            return Precision(cpu_autocast_bf16=True)
        warn_once("--param_dtype bf16: this CPU has no native bf16 (avx512_bf16/AMX); training in fp32.")
    return Precision()
