"""Training checkpoints from Python: the C++ side's (include/ztrain/ckpt/checkpoint.h).

    manager = ztrain.optim.OptimManager(model); manager.add_optimizer(opt, scheduler)
    ztrain.save_checkpoint("ckpt", step, manager, extra={"data": position}, keep_last=3)   # collective
    ...
    if (latest := ztrain.latest_checkpoint("ckpt")) is not None:
        info = ztrain.load_checkpoint(latest, manager)         # any world size
        position = info["extra"]["data"]

A checkpoint is the directory `<root>/step-<8 digits>/`: the model file, the optimizer state file
(full tensors by parameter name: it loads at any world size and ZeRO level), each rank's
generator states, and a manifest with the OptimManager's state (loss scale, step counters), the
SHA-256 of every file and `extra`. Files are written into a temporary directory and renamed into
place, `<root>/latest` last, so a save killed at any moment leaves the previous checkpoints
intact; loading verifies every file and names a missing or corrupt one. What lives on the Python
side goes into the manifest too: each param group's hyperparameters (an LR schedule changes them)
and the state_dict() of the torch LR schedulers the manager steps, or of those passed as
`lr_schedulers`. Generator states are restored only at the same world size.
"""
import json

from . import _C

latest_checkpoint = _C.latest_checkpoint
checkpoints = _C.checkpoints

_HYPER = ("lr", "betas", "eps", "weight_decay")


def _schedulers(manager, lr_schedulers):
    return [s for s in manager.lr_schedulers if s is not None] + list(lr_schedulers)


def save_checkpoint(root, step, manager, extra=None, keep_last=0, lr_schedulers=()):
    """Writes the checkpoint of `step` under `root` for the model and the one optimizer of
    `manager` (a ztrain.optim.OptimManager) and returns its directory (collective). `extra`: any
    JSON-serialisable value (a data position, the run's configuration); keep_last > 0 keeps only
    that many newest checkpoints."""
    (optimizer,) = manager.optimizers or [None]
    if optimizer is None:
        raise _C.Error("save_checkpoint: the OptimManager has no optimizer; add_optimizer first")
    python_side = {"param_groups": [{k: group[k] for k in _HYPER} for group in optimizer.param_groups],
                   "lr_schedulers": [s.state_dict() for s in _schedulers(manager, lr_schedulers)]}
    try:
        text = json.dumps({"extra": extra, "python": python_side})
    except TypeError as e:
        raise _C.Error(f"save_checkpoint: extra and the LR schedulers' state must be JSON-serialisable: {e}") from None
    return manager._native.save_checkpoint(str(root), int(step), text, int(keep_last))


def load_checkpoint(path, manager, lr_schedulers=()):
    """Loads the checkpoint in the directory `path` (a directory save_checkpoint returned, or
    latest_checkpoint(root)) into the model, optimizer and LR schedulers of `manager`, and those
    passed as `lr_schedulers` (collective). Returns {"dir", "step", "world_size", "extra"}."""
    (optimizer,) = manager.optimizers or [None]
    if optimizer is None:
        raise _C.Error("load_checkpoint: the OptimManager has no optimizer; add_optimizer first")
    directory, step, world_size, text = manager._native.load_checkpoint(str(path))
    saved = json.loads(text)
    python_side = saved.get("python", {})
    groups = python_side.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise _C.Error(f"load_checkpoint: {directory} holds {len(groups)} param groups, the optimizer has "
                       f"{len(optimizer.param_groups)}")
    for group, hyper in zip(optimizer.param_groups, groups):
        group.update({k: tuple(v) if k == "betas" else v for k, v in hyper.items()})
    schedulers = _schedulers(manager, lr_schedulers)
    states = python_side.get("lr_schedulers", [])
    if len(states) != len(schedulers):
        raise _C.Error(f"load_checkpoint: {directory} holds the state of {len(states)} LR schedulers, "
                       f"{len(schedulers)} were given")
    for scheduler, state in zip(schedulers, states):
        scheduler.load_state_dict(state)
    return {"dir": directory, "step": step, "world_size": world_size, "extra": saved.get("extra")}
