"""Model files: ztrain's safetensors format, written and read by the C++ side (ztrain::save, load).

    ztrain.save(model, "model.safetensors")     # collective; full tensors, the names a model without Blocks has
    ztrain.load(model, "model.safetensors")     # any world size, ZeRO level or layout wrote it

A Block's parameters are saved under its module's names at the Block's path ("layers.0.fc1.weight",
not "layers.0.zero_shard_0"), gathered block by block, so the file loads into the same model
without ztrain (safetensors.torch.load_file and load_state_dict), into ztrain-gpt where the names
match, and back into a model with Blocks at any level and world size.
"""
from . import _C
from .block import native_view


def save(model, path, metadata=None):
    """Writes every parameter of `model` to the safetensors file `path` (collective over the job)."""
    _C._save(*native_view(model), str(path), dict(metadata or {}))


def load(model, path, strict=True):
    """Reads `path` into `model`'s parameters (collective). strict: an entry of the file that the
    model does not have is an error."""
    _C._load(*native_view(model), str(path), strict)
