"""ztrain.bmtrain: BMTrain's public API on ztrain's engine.

    import ztrain.bmtrain as bmt        # in place of: import bmtrain as bmt
    bmt.init_distributed(seed=0)        # mpirun -np 4 python3 train.py

Models written with bmt.DistributedModule, bmt.DistributedParameter, bmt.Block,
bmt.TransformerBlockList and bmt.nn's tensor-parallel layers, trained with bmt.optim and
bmt.lr_scheduler, run unchanged; on ranks without a GPU, `.cuda()` and `device="cuda"` mean the
rank's device (ztrain.bmtrain.placement). Where BMTrain
and ztrain differ, this module follows BMTrain (sum_loss's mean, its weight decay, its
schedules' arguments); docs/python.md has the table of every name: supported as is, differing,
or missing.
"""
import os
import random

import torch

from .. import _C
from .. import init_distributed as _init_distributed
from .. import print_rank
from .. import synchronize
from ..block import native_view
from . import distributed, inspect, loss, lr_scheduler, nn, optim, placement, utils
from .global_var import Topology, config, rank, world_size
from .layer import (Block, CheckpointBlock, DistributedModule, DistributedParameter, ParameterInitializer,
                    PipelineTransformerBlockList, TransformerBlockList, load_model_state, model_state)

__all__ = ["config", "rank", "world_size", "init_distributed", "DistributedParameter", "ParameterInitializer",
           "DistributedModule", "init_parameters", "grouped_parameters", "synchronize", "sum_loss", "Block",
           "CheckpointBlock", "TransformerBlockList", "PipelineTransformerBlockList", "save", "load", "print_rank",
           "distributed", "inspect", "loss", "lr_scheduler", "nn", "optim", "utils"]


def init_distributed(init_method="env://", seed=0, pipe_size=-1, num_micro_batches=None, tp_size=1):
    """Starts the job (collective, launched by mpirun) and fills bmt.config. Seeds torch, random
    and numpy with `seed`. Ranks are laid out as BMTrain lays them: pipeline stages of
    world_size / pipe_size consecutive ranks (config["topology"].stage_id), within a stage
    tensor-parallel groups of tp_size consecutive ranks (config["tp_rank"]); the ranks with the
    same tp_rank form the data-parallel group "tp_zero_comm" (config["tp_zero_rank"],
    config["tp_zero_size"]), one rank per stage with the same place in it the pipeline "pipe_comm".
    A PipelineTransformerBlockList cuts its batch into num_micro_batches (default pipe_size).
    On a rank whose device is not a GPU, CUDA placement (`.cuda()`, `device="cuda"`) means
    this rank's device from here on (ztrain.bmtrain.placement)."""
    pipe = max(pipe_size, 1)
    _init_distributed(seed=seed, tp_size=tp_size, pp_size=pipe)
    if torch.device(_C.device()).type != "cuda":
        placement.map_cuda_to(_C.device())
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ModuleNotFoundError:
        pass
    tp_rank, tp_size = _C._group_rank("tp"), _C._group_size("tp")
    dp_rank, dp_size = _C._group_rank("dp"), _C._group_size("dp")
    micros = pipe if num_micro_batches is None else int(num_micro_batches)
    if micros < 1:
        raise _C.Error(f"init_distributed(num_micro_batches={num_micro_batches}): must be >= 1")
    config.update(initialized=True, rank=_C.rank(), world_size=_C.world_size(), local_rank=_C.local_rank(),
                  local_size=int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")), pipe_size=pipe,
                  pipe_enabled=pipe_size > 0, micros=micros, tp_size=tp_size, tp_rank=tp_rank, zero_rank=_C.rank(),
                  zero_size=_C._group_size("stage"), tp_zero_rank=dp_rank, tp_zero_size=dp_size,
                  topology=Topology(_C.rank(), _C.world_size(), tp_size, pipe), save_param_to_cpu=True,
                  comm="comm", zero_comm="zero_comm", pp_zero_comm="pp_zero_comm", tp_comm="tp_comm",
                  tp_zero_comm="tp_zero_comm", pp_tp_zero_comm="pp_tp_zero_comm", pipe_comm="pipe_comm")


def sum_loss(loss, comm=None):
    """The mean of `loss` over every rank (BMTrain's name), with autograd."""
    return distributed.all_reduce(loss, "avg", comm)


def _named_parameters(model):
    """(name, parameter object) of every parameter of `model` under the plain model's names,
    Blocks' wrapped parameters included."""
    from .. import block as _block
    blocks = [(path, m) for path, m in model.named_modules() if isinstance(m, _block.Block)]
    inside = [path + "." for path, _ in blocks if path]
    for path, m in blocks:
        for name, p in m.module.named_parameters():
            yield (f"{path}.{name}" if path else name), p
    if not any(path == "" for path, _ in blocks):
        for name, p in model.named_parameters():
            if not any(name.startswith(prefix) for prefix in inside):
                yield name, p


def init_parameters(model):
    """Calls every DistributedParameter's init_method on its full value (fp32, rounded to the
    parameter's dtype) and keeps each rank's part; other parameters keep their values. Each
    parameter draws from torch's generator seeded from init_distributed's seed and its name, so
    the weights do not depend on the number of ranks."""
    methods = {name: p._init_method for name, p in _named_parameters(model)
               if getattr(p, "_init_method", None) is not None}

    def init(name, value, generator):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(generator.initial_seed() % (2 ** 63))
            methods[name](value)

    _C._init_parameters(*native_view(model), None, init, set(methods))


def grouped_parameters(model):
    """(group, [parameters]) by DistributedParameter group (None for the others); a Block's
    shards go under its parameters' group, which they must share."""
    from .. import block as _block
    groups = {}
    inside = []
    for path, m in model.named_modules():
        if isinstance(m, _block.Block):
            names = {getattr(p, "_group", None) for p in m.module.parameters()}
            if len(names) > 1:
                raise _C.Error(f"grouped_parameters: the Block '{path}' holds parameters of groups {sorted(map(str, names))}; "
                               "ztrain shards a Block's parameters together, so they must share one group")
            groups.setdefault(names.pop() if names else None, []).extend(m.parameters())
            inside.append(path + ".")
    for name, p in model.named_parameters():
        if not any(name.startswith(prefix) for prefix in inside):
            groups.setdefault(getattr(p, "_group", None), []).append(p)
    yield from groups.items()


def save(model, file_name, non_blocking=False):
    """torch.save of the model's full state dict (the plain model's names) by rank 0 (collective)."""
    state = model_state(model)
    if _C.rank() == 0:
        torch.save(state, file_name)
    synchronize()


def load(model, file_name, strict=True):
    """Loads a file bmt.save (or torch.save of a plain model's state_dict) wrote, on every rank."""
    state = torch.load(file_name, map_location="cpu", weights_only=True)
    return load_model_state(model, state, strict)
