"""Block: a Python module trained under ZeRO, with optional recomputation (the C++ Block).

    layer = ztrain.Block(MyLayer(), zero_level=3, use_checkpoint=True)   # collective
    y = layer(x, mask)                       # as MyLayer()(x, mask)
    opt = ztrain.optim.AdamW(layer.parameters())

Construction broadcasts the module's parameters from dp rank 0 and moves them into the
engine's flat buffers on this rank's device; the module keeps its parameter objects, whose
values the engine now owns: between steps they hold the full values at level 0 and 1 and
nothing at levels 2 and 3, where forward gathers them (and backward again, at level 3). What an
optimizer updates is `parameters()`: this rank's shard of each group of parameters of one
dtype (the whole buffer at level 0). Gradients are reduce-scattered (all-reduced at level 0)
over the data-parallel group while backward goes on, and have landed when backward returns.
A parameter with the attribute `tp_split_dim = d` (as ztrain.DistributedParameter sets it) is
this rank's slice of a tensor-parallel parameter cut along d over the tensor-parallel group:
save, load and init_parameters see its full tensor, and gradient norms count it on every tp rank.
"""
import contextlib

import torch

from . import _C
from .parameter import DistributedParameter, held_by_every_stage


def native_view(model):
    """How the C++ side sees a Python model: its Blocks with their paths ("" for a model that is
    one Block) and its DistributedParameters with their names (the engine's sharded modules),
    and its other parameters by name."""
    sharded = [(name, m._native) for name, m in model.named_modules() if isinstance(m, Block)]
    inside = [name + "." for name, _ in sharded if name]
    if any(name == "" for name, _ in sharded):
        return sharded, []
    params = []
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if isinstance(p, DistributedParameter):
            sharded.append((name, p._native))
        else:
            params.append((name, p))
    return sharded, params


@contextlib.contextmanager
def no_sync(model):
    """Backward passes inside hold the gradients of `model`'s Blocks and DistributedParameters on
    this rank, summed and unreduced; the first backward after it reduces each sum once — gradient
    accumulation that communicates once per step, as DDP's and FSDP's `no_sync`. Use it for all
    but the last micro-batch of a step, on every rank alike:

        for i, micro in enumerate(micro_batches):
            with ztrain.no_sync(model) if i + 1 < len(micro_batches) else contextlib.nullcontext():
                (loss_fn(model(micro)) / len(micro_batches)).backward()
    """
    engines = [native for _, native in native_view(model)[0]]
    before = [e.gradient_sync() for e in engines]
    for e in engines:
        e.set_gradient_sync(False)
    try:
        yield
    finally:
        for e, was in zip(engines, before):
            e.set_gradient_sync(was)


def _take_full_values(module):
    """Replaces every DistributedParameter below `module` by a Parameter of its full value
    (collective), keeping its attributes."""
    for _, m in module.named_modules():
        for name, p in list(m._parameters.items()):
            if isinstance(p, DistributedParameter):
                full = torch.nn.Parameter(p.full_value().view(p.full_shape), requires_grad=p.requires_grad)
                full.__dict__.update({k: v for k, v in p.__dict__.items() if k not in ("_native", "full_shape")})
                m._parameters[name] = full


class Block(torch.nn.Module):
    def __init__(self, module, zero_level=3, use_checkpoint=True, offload_dir=None):
        super().__init__()
        _take_full_values(module)
        named = list(module.named_parameters())
        splits = {name: p.tp_split_dim for name, p in named if getattr(p, "tp_split_dim", None) is not None}
        self._native = _C._Block(named, zero_level, use_checkpoint, splits, offload_dir)
        held_by_every_stage(self._native)
        # Not a submodule: its parameters are views of the engine's buffers, not what is trained.
        object.__setattr__(self, "module", module)
        self.zero_level = zero_level
        for index, shard in enumerate(self._native.shards()):
            # The engine reduces gradients into this very tensor, so it becomes a Parameter in
            # place (Parameter(shard) would make another tensor over the same memory).
            shard.__class__ = torch.nn.Parameter
            shard._native = self._native  # which engine module owns it
            self.register_parameter(f"zero_shard_{index}", shard)

    def forward(self, *args, **kwargs):
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise _C.Error("Block: pass tensors positionally (keyword tensors would get no gradient)")
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        single = []

        def call(tensors):
            full = list(args)
            for i, t in zip(positions, tensors):
                full[i] = t
            out = self.module(*full, **kwargs)
            if isinstance(out, torch.Tensor):
                single.append(True)
                return [out]
            if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
                single.append(False)
                return list(out)
            raise _C.Error(f"Block: the wrapped forward must return a tensor or a tuple of tensors, got {type(out)}")

        outputs = self._native.forward(call, [args[i] for i in positions])
        return outputs[0] if single[0] else tuple(outputs)

    def train(self, mode=True):
        super().train(mode)
        self.module.train(mode)
        self._native.train(mode)
        return self

    def gathered_parameters(self):
        """{name: full value} of the wrapped module's parameters, gathered (collective)."""
        return dict(self._native.gathered_parameters())

    def parameter_bytes(self):
        """Bytes this rank keeps for the parameters between steps."""
        return self._native.parameter_bytes()

    def gathered_bytes(self):
        """Bytes of full parameters now allocated (gathered or being gathered); none where the
        full parameters map the ranks' shards (maps_shards)."""
        return self._native.gathered_bytes()

    def maps_shards(self):
        """Whether the full parameters map the dp ranks' shards instead of holding gathered copies
        (levels 2-3 with every dp rank on this host and host-shared buffers, for large groups)."""
        return self._native.maps_shards()


class BlockList(torch.nn.Module):
    """Blocks run in order, the next ones' parameters gathered while the current one computes
    (the C++ BlockList): in forward, block i starts gathering blocks i+1 … i+prefetch_depth
    before it computes, in backward blocks i−1 … i−prefetch_depth, so at level 3 at most
    1 + prefetch_depth blocks hold their full parameters at a time.

        layers = ztrain.BlockList([Layer() for _ in range(12)], zero_level=3)   # collective
        h = layers(x, mask)            # x = block(x, mask) through every block
        for block in layers: ...       # or block by block

    Items that are Blocks already are taken as they are (with their own options); modules are
    wrapped with the given ones. Blocks are children "0", "1", …, as in a torch.nn.ModuleList.
    """

    def __init__(self, modules, zero_level=3, use_checkpoint=True, prefetch_depth=1, offload_dir=None):
        super().__init__()
        blocks = [m if isinstance(m, Block) else Block(m, zero_level, use_checkpoint, offload_dir) for m in modules]
        if len({id(b) for b in blocks}) != len(blocks):
            raise _C.Error("BlockList: a block appears twice; build one module per layer")
        for index, block in enumerate(blocks):
            self.add_module(str(index), block)
        _C._link_blocks([b._native for b in blocks], prefetch_depth)
        self.prefetch_depth = prefetch_depth

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        return list(self._modules.values())[index]

    def forward(self, x, *extra, **kwargs):
        """x = block(x, *extra, **kwargs) through every block; each returns one tensor."""
        for block in self:
            x = block(x, *extra, **kwargs)
            if not isinstance(x, torch.Tensor):
                raise _C.Error("BlockList: each block must return one tensor to pass on; loop over the blocks "
                               "for others")
        return x
