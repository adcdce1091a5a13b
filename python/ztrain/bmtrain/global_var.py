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
    """BMTrain's config["topology"]: where this rank sits. stage_id is its pipeline stage (of
    `stages`) and pipe_idx its place in the stage, which is also the index of its pipeline
    group; tp_id is the rank in its tensor-parallel group and tp_idx the group's index;
    tp_zero_id and tp_zero_idx the same for the data-parallel group of the ranks with one tp_id;
    pp_zero_* for the ranks of one stage, pp_tp_zero_* for the data-parallel ranks of one stage;
    zero_id is the rank."""

    def __init__(self, rank, world_size, tp_size, pipe_size=1):
        stage_size = world_size // pipe_size
        self.rank = rank
        self.tp_size = tp_size
        self.pipe_size = self.stages = pipe_size
        self.stage_id = rank // stage_size
        self.pipe_idx = rank % stage_size
        self.zero_id = rank
        self.zero_idx = 0
        self.tp_id = rank % tp_size
        self.tp_idx = rank // tp_size
        self.tp_zero_id = self.tp_idx
        self.tp_zero_idx = self.tp_id
        self.pp_zero_id = self.pipe_idx
        self.pp_zero_idx = self.stage_id
        self.pp_tp_zero_id = self.pipe_idx // tp_size
        self.pp_tp_zero_idx = self.stage_id * tp_size + self.tp_id

    def get_group_id(self, group_name):
        """The index of this rank's group of kind "pipe", "zero", "tp_zero" or "tp"."""
        return {"pipe": self.pipe_idx, "zero": self.zero_idx, "tp_zero": self.tp_zero_idx, "tp": self.tp_idx}[group_name]

    def get_group_rank(self, group_name):
        """This rank's position in its group of kind "pipe", "zero", "tp_zero" or "tp"."""
        return {"pipe": self.stage_id, "zero": self.zero_id, "tp_zero": self.tp_zero_id, "tp": self.tp_id}[group_name]
