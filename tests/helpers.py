"""Tolerances and input makers shared by the tests (stated once, here)."""
import torch

# Kernel output (fp32 accumulation) vs a float64 reference, per *input* dtype.
TOLERANCE = {
    torch.float64: dict(atol=1e-9, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


def tol(dtype: torch.dtype) -> dict:
    return TOLERANCE[dtype]
