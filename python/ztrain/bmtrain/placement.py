"""BMTrain scripts place tensors on the GPU by name (`.cuda()`, `device="cuda"`,
`torch.cuda.memory_summary()`); ztrain's ranks may have none. When this rank's device is not a
GPU, init_distributed makes CUDA placement mean this rank's device, so such a script runs as it
is: a torch function mode (torch.overrides.TorchFunctionMode) on the thread that initialised,
which also sees the engine's recomputation in backward, maps

- `Tensor.cuda()`, `Module.cuda()` → this rank's device;
- a `device=` argument naming CUDA ("cuda", "cuda:1", torch.device("cuda"), an ordinal) → this
  rank's device, in every torch function that takes one, and a CUDA device given to `Tensor.to`;

and torch.cuda.memory_summary(), which fails without a GPU, reports this process's memory.
Other torch.cuda calls are left alone (most are no-ops without a GPU; synchronize() fails).

Scripts written for GPUs train in fp16 or bf16, whose matrix products a CPU without native
kernels for them (AMX-FP16 for fp16; AVX512-BF16 or AMX for bf16) runs some 60 times slower
than fp32 in libtorch. Under the mode, matrix products of such tensors (matmul, mm, bmm, linear)
multiply in fp32 and round the result to the tensors' dtype, as GPU tensor cores accumulate.
"""
import functools
import resource

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


@functools.cache
def _native_kernels(dtype):
    """Whether this CPU multiplies `dtype` natively (torch.cpu's feature probes)."""
    def probe(name):
        return getattr(torch.cpu, name, lambda: False)()
    if dtype == torch.float16:
        return probe("_is_amx_fp16_supported")
    return probe("_is_avx512_bf16_supported") or probe("_is_amx_tile_supported")


def widened(x):
    """Whether products of `x` run in fp32 (a CPU fp16/bf16 tensor without native kernels)."""
    return x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16) and not _native_kernels(x.dtype)


_PRODUCTS = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm,
             torch.Tensor.__matmul__, F.linear}


def _widen(dtype, value):
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == dtype else value


def _is_cuda(device):
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a CUDA ordinal
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


class CudaToDevice(TorchFunctionMode):
    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(self.device)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = self.device
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.dtype) and _is_cuda(args[1]):
            args = (args[0], self.device) + tuple(args[2:])
        if func in _PRODUCTS and "out" not in kwargs and isinstance(args[0], torch.Tensor) and widened(args[0]):
            dtype = args[0].dtype
            out = func(*(_widen(dtype, a) for a in args), **{k: _widen(dtype, v) for k, v in kwargs.items()})
            return out.to(dtype)
        return func(*args, **kwargs)


def _memory_summary(device=None, abbreviated=False):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (f"(ztrain.bmtrain: this rank runs on the CPU, not CUDA) peak resident memory of this process: "
            f"{usage.ru_maxrss / 1024:.1f} MiB")


def map_cuda_to(device):
    """Makes CUDA placement mean `device` on this thread (see the module's docstring)."""
    mode = CudaToDevice(device)
    mode.__enter__()
    if not torch.cuda.is_available():
        torch.cuda.memory_summary = _memory_summary
    return mode
