"""BMTrain's `config`: the job's layout after init_distributed, read as bmt.config["rank"].

Groups are named where BMTrain keeps NCCL communicators ("comm", "zero_comm", "tp_comm", ...):
ztrain.bmtrain.distributed takes those names as its `comm` argument.
"""
config = {"initialized": False}


def world_size():
    return config["world_size"]


def rank():
    return config["rank"]
