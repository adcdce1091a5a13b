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
"""
import torch

from . import _C


class Block(torch.nn.Module):
    def __init__(self, module, zero_level=3, use_checkpoint=True):
        super().__init__()
        named = list(module.named_parameters())
        self._native = _C._Block(named, zero_level, use_checkpoint)
        # Not a submodule: its parameters are views of the engine's buffers, not what is trained.
        object.__setattr__(self, "module", module)
        self.zero_level = zero_level
        for index, shard in enumerate(self._native.shards()):
            # The engine reduces gradients into this very tensor, so it becomes a Parameter in
            # place (Parameter(shard) would make another tensor over the same memory).
            shard.__class__ = torch.nn.Parameter
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
