"""Model files and initialisation: ztrain's safetensors format, written and read by the C++ side (ztrain::save, load).

    ztrain.save(model, "model.safetensors")     # collective; full tensors, the names a model without Blocks has
    ztrain.load(model, "model.safetensors")     # any world size, ZeRO level or layout wrote it

A Block's parameters are saved under its module's names at the Block's path ("layers.0.fc1.weight",
not "layers.0.zero_shard_0"), gathered block by block, so the file loads into the same model
without ztrain (safetensors.torch.load_file and load_state_dict), into ztrain-gpt where the names
match, and back into a model with Blocks at any level and world size.
"""
from . import _C
from . import pipeline as _pipeline
from .block import native_view


def save(model, path, metadata=None):
    """Writes every parameter of `model` to the safetensors file `path` (collective over the job)."""
    _C._save(*native_view(model), str(path), dict(metadata or {}))


def load(model, path, strict=True):
    """Reads `path` into `model`'s parameters (collective). strict: an entry of the file that the
    model does not have is an error."""
    _C._load(*native_view(model), str(path), strict)


def save_optimizer(model, optimizer, path):
    """Writes the state of `optimizer` (a ztrain.optim AdamW or Adam over `model`'s parameters or
    Blocks' shards) to the safetensors file `path`: every state tensor under
    "<parameter name>.<state>" with the parameter's full shape, the step counters in the
    metadata (the C++ save_optimizer_state). Collective; the file does not depend on the world
    size or ZeRO level that wrote it. Hyperparameters are not stored: the run that loads decides."""
    _C._save_optimizer(*native_view(model), _native_optimizer("save_optimizer", optimizer), str(path))


def load_optimizer(model, optimizer, path):
    """Reads a file of save_optimizer into `optimizer`, written at any world size and ZeRO level
    (each rank takes the elements it holds). Collective."""
    _C._load_optimizer(*native_view(model), _native_optimizer("load_optimizer", optimizer), str(path))


def _native_optimizer(what, optimizer):
    from .optim import AdamOffload, _NativeAdam
    if not isinstance(optimizer, _NativeAdam) or isinstance(optimizer, AdamOffload):
        raise _C.Error(f"{what}: takes a ztrain.optim.AdamW or Adam, got {type(optimizer).__name__} "
                       "(torch optimizers: torch.save(optimizer.state_dict()) on each rank)")
    optimizer._native.wait()
    return optimizer._native


def init_parameters(model, seed=None, init=None):
    """Initialises every parameter of `model` independently of the number of ranks (the C++
    init_parameters): each is drawn in full, in fp32, from a generator seeded from `seed` (default:
    init_distributed's) and its name — the name the model without Blocks has — and each rank keeps
    what it holds. The default rule is GPT-2's: N(0, 0.02²) for weights of two or more
    dimensions, zero for names ending in "bias", one for other one-dimensional parameters.
    `init(name, tensor, generator)` replaces it, filling the fp32 tensor in place."""
    _C._init_parameters(*native_view(model), seed, init, None)


def memory_stats(model, optimizer=None):
    """Bytes this rank holds (the C++ memory_stats; not collective): "parameter_bytes" (what
    stays between steps: a Block's full buffer at levels 0-1, its shard at 2-3, other parameters
    in full), "gathered_bytes" (full buffers of levels 2-3 allocated now), "gradient_bytes",
    "optimizer_bytes" (a ztrain.optim optimizer's state), "rss_bytes" and "peak_rss_bytes"."""
    from .optim import _NativeAdam
    if optimizer is not None and not isinstance(optimizer, _NativeAdam):
        raise _C.Error(f"memory_stats: counts the state of ztrain.optim optimizers, got {type(optimizer).__name__}")
    return _C._memory_stats(*native_view(model), optimizer._native if optimizer is not None else None)


def state_dict(model):
    """{name: full tensor} of every parameter of `model`, named as ztrain.save names them
    (collective: Blocks and DistributedParameters are gathered one at a time); the same dict on
    every rank, every pipeline stage's layers included."""
    out = dict(_C._gathered_parameters(*native_view(model)))
    if _pipeline.stages()[0] > 1:
        local = _pipeline.stage_local_names(model)
        for part in _pipeline.stage_objects({k: v for k, v in out.items() if k in local}):
            out.update(part)
    return out


def load_state_dict(model, state_dict, strict=True):
    """Writes full tensors, named as state_dict() names them, into `model`'s parameters: each rank
    keeps what it holds (every rank passes the same values; no communication but between pipeline
stages, which learn each other's names). strict: a
    parameter the dict lacks, or an entry the model lacks, is an error. A shape that differs is
    always one."""
    blocks, params = native_view(model)
    shapes = {name: tuple(shape) for name, shape in _C._parameter_shapes(blocks, params)}
    everywhere = set(shapes)  # the other pipeline stages' layers are expected too
    if _pipeline.stages()[0] > 1:
        everywhere = everywhere.union(*_pipeline.stage_objects(sorted(shapes)))
    missing = sorted(set(shapes) - set(state_dict))
    unexpected = sorted(set(state_dict) - everywhere)
    if strict and (missing or unexpected):
        raise _C.Error(f"load_state_dict: the model's parameters {missing} are not in the dict, and its entries "
                       f"{unexpected} are not parameters of the model")
    for name in set(shapes) & set(state_dict):
        if tuple(state_dict[name].shape) != shapes[name]:
            raise _C.Error(f"load_state_dict: '{name}' is {tuple(state_dict[name].shape)} in the dict, "
                           f"{shapes[name]} in the model")

    def copy(name, value, generator):
        value.copy_(state_dict[name])

    _C._init_parameters(blocks, params, None, copy, set(shapes) & set(state_dict))
