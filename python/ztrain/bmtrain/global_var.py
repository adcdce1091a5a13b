"""BMTrain's `config`: the job's layout after init_distributed, read as bmt.config["rank"].

Groups are named where BMTrain keeps NCCL communicators ("comm", "zero_comm", "tp_comm", ...):
ztrain.bmtrain.distributed takes those names as its `comm` argument.
"""
from .. import _C

config = {"initialized": False}


def _get(key):
    if not config["initialized"]:
        raise _C.Error("ztrain.bmtrain is not initialized: call bmt.init_distributed() first")
    return config[key]


def world_size():
    return _get("world_size")


def rank():
    return _get("rank")
