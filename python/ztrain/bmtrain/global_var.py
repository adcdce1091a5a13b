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


class Topology:
    """BMTrain's config["topology"] without pipelines: where this rank sits. tp_id is the rank in
    its tensor-parallel group and tp_idx the group's index; tp_zero_id and tp_zero_idx the same
    for the data-parallel group of the ranks with one tp_id; zero_id is the rank in the stage."""

    def __init__(self, rank, tp_size):
        self.rank = rank
        self.tp_size = tp_size
        self.pipe_size = 1
        self.stage_id = 0
        self.pipe_idx = rank
        self.zero_id = rank
        self.zero_idx = 0
        self.tp_id = rank % tp_size
        self.tp_idx = rank // tp_size
        self.tp_zero_id = self.tp_idx
        self.tp_zero_idx = self.tp_id

    def get_group_id(self, group_name):
        """The index of this rank's group of kind "pipe", "zero", "tp_zero" or "tp"."""
        return {"pipe": self.pipe_idx, "zero": self.zero_idx, "tp_zero": self.tp_zero_idx, "tp": self.tp_idx}[group_name]

    def get_group_rank(self, group_name):
        """This rank's position in its group of kind "pipe", "zero", "tp_zero" or "tp"."""
        return {"pipe": self.stage_id, "zero": self.zero_id, "tp_zero": self.tp_zero_id, "tp": self.tp_id}[group_name]
