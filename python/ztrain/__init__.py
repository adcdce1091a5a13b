"""ztrain from Python: the native engine on ordinary torch tensors and modules.

    import torch, ztrain
    ztrain.init_distributed(seed=0)             # mpirun -np 4 python3 train.py
    opt = ztrain.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    ...
    loss.backward(); opt.step()
    ztrain.print_rank("loss", ztrain.sum_loss(loss).item())

Errors of the native side arrive as ztrain.Error (a RuntimeError) with the native message;
communication failures as ztrain.CommError (an Error) naming the rank, the operation and the peer.
"""
import atexit
import sys

import torch  # loads libtorch before the extension that links it

from . import _C
from ._C import CommError, Error
from . import optim
from . import booster
from . import nn
from .block import Block, BlockList, no_sync
from .checkpoint import checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint
from .model_file import (init_parameters, load, load_optimizer, load_state_dict, memory_stats, save, save_optimizer,
                         state_dict)
from .parameter import DistributedParameter
from .pipeline import PipelineBlockList, data_parallel

__all__ = ["Error", "CommError", "init_distributed", "is_initialized", "finalize_distributed", "rank",
           "world_size", "local_rank", "device", "synchronize", "sum_loss", "print_rank", "optim", "Block",
           "BlockList", "PipelineBlockList", "data_parallel", "no_sync", "DistributedParameter", "save", "load",
           "save_optimizer", "load_optimizer", "state_dict", "load_state_dict", "init_parameters", "memory_stats",
           "save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoints", "booster", "nn"]


def init_distributed(seed=0, tp_size=1, pp_size=1, timeout=None, device=None, threads=None, backend=None):
    """Starts the runtime over every process of the job (collective): MPI, the parallel
    layout (tp × pp × dp), this rank's device ("cpu", "cuda", "cuda:N"; default ZTRAIN_DEVICE,
    else the CPU), the communication backend ("mpi", or "nccl" on CUDA devices where the build
    has it; default ZTRAIN_BACKEND, else "mpi"), the deadline of every communication wait in seconds (default
    ZTRAIN_TIMEOUT_S, else 300) and the intra-op threads (default OMP_NUM_THREADS, else the
    host's cores divided by its ranks). Seeds torch's generators with `seed`.

    An exception no one catches on one rank ends the whole job (the others would wait for it
    until their deadline); the runtime is finalised at exit."""
    _C.init_distributed(seed, tp_size, pp_size, timeout, device, threads, backend)
    atexit.register(_finalize_at_exit)
    if _C.world_size() > 1:
        sys.excepthook = _abort_on_uncaught(sys.excepthook)


def _finalize_at_exit():
    if _C.is_initialized():
        _C.finalize_distributed()


def _abort_on_uncaught(previous):
    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        # A communication failure reaches every rank by itself within its deadline.
        if not issubclass(kind, CommError) and _C.is_initialized():
            sys.stdout.flush()
            sys.stderr.flush()
            _C.abort_distributed(1)
    return hook


is_initialized = _C.is_initialized
finalize_distributed = _C.finalize_distributed
rank = _C.rank
world_size = _C.world_size
local_rank = _C.local_rank
synchronize = _C.synchronize


def device():
    """This rank's device, as a torch.device."""
    return torch.device(_C.device())


def sum_loss(loss):
    """The mean of a per-rank loss over the ranks that take different data — the data-parallel
    group, and the pipeline stages when each brings its own part (a mean, as BMTrain's sum_loss
    gives, despite the name): detached, on every rank."""
    out = _C.sum_loss(loss)
    if _C._group_size("pp") > 1:
        out = out.detach().clone()
        _C._all_reduce(out, "avg", "pp")
    return out


def print_rank(*args, rank=0, **kwargs):
    """print() on one rank only (rank 0 by default)."""
    if _C.rank() == rank:
        print(*args, **kwargs, flush=True)
