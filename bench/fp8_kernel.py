"""The fused CUDA block-FP8 quantizer (mcore2hf/quantize_cuda.py) against the torch reference: bit-identity for
every shape class, then speed against the reference and a plain device copy of the same bytes (the floor).

    python bench/fp8_kernel.py                 # on a GPU: checks, then the table
    python bench/fp8_kernel.py --quick         # fewer / smaller stacks

Bit-identity: every fp8 byte and every scale of the kernel equals the torch reference (quantize.py, DeepGEMM's
arithmetic) computed on the CPU from the same input, for full blocks, partial edge blocks in either dim, 1-row and
1-column weights, bf16 and fp32 inputs, zero blocks, strided inputs (a transposed view), both scale formats.
Speed: expert stacks [E, rows, 2048] bf16 (Qwen3-30B-A3B's fc1/fc2 and DeepSeek-V3's shapes): GB/s of bytes read +
written (bf16 in, fp8 + scales out), against the reference on the GPU and against a device copy of the input."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(torch.int32)


def check(device: torch.device) -> list[str]:
    from mcore2hf.quantize import fp8 as quantize
    from mcore2hf.quantize.fp8_cuda import block_cast_to_fp8

    g = torch.Generator().manual_seed(0)
    problems, n = [], 0
    shapes = [(128, 128), (256, 384), (300, 200), (129, 1000), (7, 5), (1, 129), (129, 1), (1, 1), (2048, 768),
              (768, 2048), (4096, 7168)]
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)
            if shape[0] >= 256 and shape[1] >= 256:
                x[:128, :128] = 0  # a zero block: scale 1e-4 / 448, fp8 zeros
            for ue8m0 in (False, True):
                for strided in (False, True):
                    src = x.t().contiguous().t() if strided else x  # a column-major view of the same values
                    ref_q, ref_s = quantize.per_block_cast_to_fp8(src, ue8m0)  # CPU: the reference
                    q, s = block_cast_to_fp8(src.to(device), ue8m0)
                    n += 1
                    if not (torch.equal(_bits(q.cpu()), _bits(ref_q)) and torch.equal(_bits(s.cpu()), _bits(ref_s))):
                        bad = (_bits(q.cpu()) != _bits(ref_q)).sum().item()
                        problems.append(f"{shape} {dtype} ue8m0={ue8m0} strided={strided}: {bad} fp8 bytes differ, "
                                        f"scales {'equal' if torch.equal(s.cpu(), ref_s) else 'differ'}")
    stack = torch.randn(3, 300, 200, generator=g).bfloat16()
    q, s = block_cast_to_fp8(stack.to(device), False)
    rq, rs = quantize.per_block_cast_to_fp8_batched(stack, False)
    n += 1
    if not (torch.equal(_bits(q.cpu()), _bits(rq)) and torch.equal(s.cpu(), rs)):
        problems.append("stack [3, 300, 200]: differs")
    print(f"bit-identity: {n - len(problems)}/{n} cases equal to the CPU reference")
    return problems


def speed(device: torch.device, quick: bool) -> None:
    import triton

    from mcore2hf.quantize import fp8 as quantize
    from mcore2hf.quantize.fp8_cuda import block_cast_to_fp8

    cases = [(128, 768), (128, 1536)] if quick else [(128, 768), (128, 1536), (256, 2048), (64, 7168)]
    print(f"{'stack':<22} {'MB':>8} {'kernel ms':>10} {'GB/s':>8} {'torch ms':>9} {'GB/s':>8} {'copy ms':>8} "
          f"{'GB/s':>8} {'kernel/copy':>11} {'torch/kernel':>12}")
    for e, rows in cases:
        x = torch.randn(e, rows, 2048, device=device, dtype=torch.bfloat16)
        moved = x.numel() * (2 + 1) + x.numel() // (128 * 128) * 4  # bf16 read, fp8 written, scales written
        k_ms = triton.testing.do_bench(lambda x=x: block_cast_to_fp8(x, False), warmup=25, rep=200, return_mode="median")
        os.environ["MCORE2HF_FP8_KERNEL"] = "torch"
        t_ms = triton.testing.do_bench(lambda x=x: quantize.per_block_cast_to_fp8_batched(x, False), warmup=25, rep=200,
                                       return_mode="median")
        del os.environ["MCORE2HF_FP8_KERNEL"]
        y = torch.empty_like(x)
        c_ms = triton.testing.do_bench(lambda x=x, y=y: y.copy_(x), warmup=25, rep=200, return_mode="median")
        copy_bytes = 2 * x.numel() * 2
        print(f"{f'{e}x{rows}x2048':<22} {moved / 1e6:>8.0f} {k_ms:>10.3f} {moved / k_ms / 1e6:>8.0f} {t_ms:>9.3f} "
              f"{moved / t_ms / 1e6:>8.0f} {c_ms:>8.3f} {copy_bytes / c_ms / 1e6:>8.0f} {k_ms / c_ms:>11.2f} "
              f"{t_ms / k_ms:>12.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    problems = check(device)
    for line in problems[:20]:
        print("  DIFFERS:", line)
    speed(device, a.quick)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
