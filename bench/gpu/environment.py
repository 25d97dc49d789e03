"""What ran: the GPU, its memory, torch / CUDA / transformers versions, which optional packages
import, and the two ceilings every later figure is read against (copy bandwidth, bf16 matmul rate)."""

from __future__ import annotations

import importlib
import platform
import subprocess

import torch

from bench.gpu.context import Context

OPTIONAL = ("transformers", "safetensors", "tokenizers", "triton", "flash_attn", "flashinfer", "xformers", "scipy",
            "llguidance", "ray", "fastapi", "vllm", "sglang")


def run(ctx: Context, out: dict) -> None:
    out["python"] = platform.python_version()
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["packages"] = {name: _version(name) for name in OPTIONAL}
    if ctx.device.startswith("cuda"):
        dev = torch.device(ctx.device)
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                   memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1), driver=_driver(),
                   cudnn=torch.backends.cudnn.version(), tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    else:
        from bench.common import host_class
        out["gpu"] = None
        out["host"] = host_class()
    ctx.log(f"device {out.get('gpu') or out.get('host')}, torch {out['torch']}, cuda {out['cuda']}")
    out["copy_tb_s"] = _copy_bandwidth(ctx)
    out["bf16_matmul_tflop_s"] = _matmul_rate(ctx)
    ctx.log(f"copy {out['copy_tb_s']:.3f} TB/s (read + written), bf16 matmul {out['bf16_matmul_tflop_s']:.1f} TFLOP/s")
    out["summary"] = [f"{out.get('gpu') or out.get('host')}; torch {out['torch']}, CUDA {out['cuda']}, "
                      f"transformers {out['packages']['transformers']}",
                      f"measured ceilings: copy {out['copy_tb_s']:.2f} TB/s (bytes read + written), "
                      f"bf16 matmul {out['bf16_matmul_tflop_s']:.0f} TFLOP/s",
                      "optional packages: " + ", ".join(f"{k} {v}" for k, v in out["packages"].items() if v)]


def _version(name: str) -> str | None:
    try:
        module = importlib.import_module(name)
    except Exception:  # not installed, or broken on this machine: either way not usable
        return None
    return str(getattr(module, "__version__", "present"))


def _driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _median_seconds(ctx: Context, fn, repeats: int) -> float:
    fn()
    times = sorted(ctx.timed(fn)[1] for _ in range(repeats))
    return times[len(times) // 2]


def _copy_bandwidth(ctx: Context) -> float:
    """TB/s of a device-to-device copy, bytes read plus bytes written."""
    n = ctx.size(1 << 30, 1 << 24)  # 2 GiB of bf16 on the GPU
    src = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = _median_seconds(ctx, lambda: dst.copy_(src), ctx.size(10, 3))
    return 2 * src.numel() * src.element_size() / seconds / 1e12


def _matmul_rate(ctx: Context) -> float:
    n = ctx.size(8192, 256)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    seconds = _median_seconds(ctx, lambda: a @ b, ctx.size(10, 3))
    return 2 * n**3 / seconds / 1e12
