"""DistributedParameter: one parameter sharded over the data-parallel group outside any Block
(the C++ DistributedParameter), as BMTrain's.

    class Embedding(torch.nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.weight = ztrain.DistributedParameter(torch.empty(vocab, dim))   # collective
        def forward(self, ids):
            return torch.nn.functional.embedding(ids, self.weight.gather())

With `tp_split_dim=d` the value is this rank's slice of a tensor-parallel parameter: its full
tensor cut along dimension d into one equal chunk per rank of the tensor-parallel group, chunk r
on tp rank r (Megatron's cut); save, load and init_parameters then see the full tensor.

Construction broadcasts the value from dp rank 0 and keeps this rank's shard: what the module
registers, and what an optimizer updates, is that flat shard (its gradient is reduce-scattered
into it by backward). gather() returns the full tensor, connected to autograd; within one forward
it gathers once and hands back the same tensor, so a weight used twice (a tied embedding and
head) is gathered once and its gradient reduced once. ztrain.save, load and init_parameters see
it as `<module path>.<attribute>` with its full shape. A Block built over a module that holds
DistributedParameters takes their full values into its own buffers.
"""
import torch

from . import _C


class DistributedParameter(torch.nn.Parameter):
    def __new__(cls, data, requires_grad=True, zero_level=2, tp_split_dim=None):
        if not isinstance(data, torch.Tensor):
            raise _C.Error(f"DistributedParameter: the value must be a tensor, got {type(data).__name__}")
        native = _C._Parameter(data.detach().requires_grad_(requires_grad), zero_level, tp_split_dim)
        held_by_every_stage(native)
        (shard,) = native.shards()
        # The engine reduces gradients into this very tensor, so it changes class in place.
        shard.__class__ = cls
        shard._native = native
        shard.full_shape = torch.Size(data.shape)  # of this tp rank's slice
        shard.tp_split_dim = tp_split_dim
        return shard

    def __init__(self, *args, **kwargs):
        pass

    def gather(self):
        """The full tensor (collective over the data-parallel group)."""
        return self._native.gather()

    def full_value(self):
        """A detached copy of the full tensor (collective)."""
        with torch.no_grad():
            return self._native.gather().detach().clone()

    def __repr__(self):
        return f"DistributedParameter(shard of {tuple(self.full_shape)}, {self.dtype}, {self.numel()} elements here)"

    def __reduce_ex__(self, protocol):
        raise _C.Error("DistributedParameter: a shard cannot be pickled or copied; save the model with ztrain.save")


def all_reduce_gradients(params, op, group):
    """Reduces the gradients of `params` over `group` in place ("sum" or "avg"), one collective
    per dtype over the gradients laid end to end; a missing gradient counts as zero. Every rank
    passes the same parameters in the same order."""
    by_dtype = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        _C._all_reduce(flat, op, group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def held_by_every_stage(native):
    """Marks an engine module as held by every pipeline stage (how a global gradient norm counts
    it), as all are but a PipelineBlockList's blocks."""
    stages = _C._group_size("pp")
    if stages > 1:
        native.set_tied_copies(stages)
