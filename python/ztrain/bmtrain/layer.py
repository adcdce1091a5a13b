"""BMTrain's model vocabulary on ztrain's engine: DistributedParameter, ParameterInitializer,
DistributedModule, Block (CheckpointBlock), TransformerBlockList."""
import collections

import torch

from .. import _C
from .. import block as _block
from .. import parameter as _parameter
from .. import pipeline as _pipeline
from ..nn import _CopyToTp
from .distributed import all_gather
from .global_var import config


def _require_init(who):
    if not config["initialized"]:
        raise _C.Error(f"{who}: ztrain.bmtrain is not initialized; call bmt.init_distributed() first")


class DistributedParameter(_parameter.DistributedParameter):
    """BMTrain's DistributedParameter: sharded over the data-parallel group at construction
    (collective), gathered where a DistributedModule reads it, taken whole into a Block that
    wraps its module. `init_method(tensor)` fills the full tensor in bmt.init_parameters.

    With tp_mode=True and tp_split_dim=d >= 0, `data` is this tp rank's slice of the full tensor
    (BMTrain's tensor-parallel parameter: the full tensor chunked along d, chunk tp_rank here);
    init_parameters, save and load see the full tensor. Every other parameter is replicated over
    the tensor-parallel group: its gradient is the sum of the tp ranks' (in BMTrain each tp rank
    adds its part through the ZeRO reduction over all the stage's ranks)."""

    def __new__(cls, data, requires_grad=True, init_method=None, group=None, tp_mode=False, tp_split_dim=-1):
        _require_init("DistributedParameter")
        split = tp_split_dim if tp_mode and tp_split_dim >= 0 else None
        p = super().__new__(cls, data, requires_grad=requires_grad, zero_level=2, tp_split_dim=split)
        p._init_method = init_method
        p._group = group if not tp_mode else "tp"
        p._in_block = False
        p._tp_mode = tp_mode
        p._tp_split_dim = tp_split_dim
        shape = list(data.shape)
        if split is not None:
            shape[split] *= config["tp_size"]
        p._tp_original_shape = torch.Size(shape)
        return p

    @property
    def group(self):
        return self._group

    def gather_all(self):
        """The full tensor, gathered over the data-parallel and tensor-parallel groups."""
        return _tp_gather(self.gather(), self.tp_split_dim)

    def tp_gather(self):
        """The full tensor, as gather_all: a DistributedParameter outside a Block is read by
        gathering its data-parallel shards first."""
        return self.gather_all()


def _tp_gather(x, dim):
    if dim is None or config["tp_size"] == 1:
        return x
    return torch.cat(all_gather(x, "tp_comm").unbind(0), dim=dim)


def _replicated_over_tp(p):
    return config.get("tp_size", 1) > 1 and getattr(p, "tp_split_dim", None) is None


class ParameterInitializer:
    """`func(tensor, *args, **kwargs)` as an init_method, as functools.partial."""

    def __init__(self, func, *args, **kwargs):
        self.func = func
        self.args = args
        self.kwargs = kwargs

    def __call__(self, param):
        return self.func(param, *self.args, **self.kwargs)


class DistributedModule(torch.nn.Module):
    """A torch.nn.Module whose DistributedParameters read as their full values (this tp rank's
    slice of a tensor-parallel one); state_dict and load_state_dict take and give full tensors
    under the names of the model without Blocks. With tp_size > 1, a parameter replicated over
    the tensor-parallel group reads through an identity whose backward sums its gradient over
    that group."""

    def __getattr__(self, name):
        value = super().__getattr__(name)
        if isinstance(value, torch.nn.Parameter):
            replicated = _replicated_over_tp(value)
            if isinstance(value, _parameter.DistributedParameter):
                value = value.gather()
            if replicated and torch.is_grad_enabled() and value.requires_grad:
                value = _CopyToTp.apply(value)  # the identity whose backward sums over tp
        return value

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        out = collections.OrderedDict() if destination is None else destination
        for name, value in model_state(self).items():
            out[prefix + name] = value
        return out

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return load_model_state(self, state_dict, strict)


def _persistent_buffers(module, prefix):
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer


def named_buffers(model, stage_local_only=False):
    """The persistent buffers of `model`, Blocks' modules included, by the plain model's names;
    stage_local_only: those of this pipeline stage's blocks alone (no other stage holds them)."""
    for path, m in model.named_modules():
        if stage_local_only and not getattr(m, "_pipeline_stage", False):
            continue
        prefix = path + "." if path else ""
        yield from _persistent_buffers(m, prefix)
        if isinstance(m, _block.Block):
            for sub, inner in m.module.named_modules():
                yield from _persistent_buffers(inner, prefix + (sub + "." if sub else ""))


def _from_other_stages(local):
    """The dicts the other pipeline stages pass as `local`, merged (collective over the pipeline
    group; nothing with one stage)."""
    size, stage = _pipeline.stages()
    out = {}
    if size > 1:
        for index, part in enumerate(_pipeline.stage_objects(local)):
            if index != stage:
                out.update(part)
    return out


def model_state(model):
    """Every parameter (full) and persistent buffer of `model` (collective), every pipeline
    stage's included."""
    from ..model_file import state_dict
    out = collections.OrderedDict(state_dict(model))
    for name, buffer in named_buffers(model):
        out[name] = buffer.detach().clone()
    out.update(_from_other_stages({name: out[name] for name, _ in named_buffers(model, stage_local_only=True)}))
    return out


def load_model_state(model, state, strict=True):
    """Loads a dict of full tensors into `model` (every rank passes the same dict; collective)."""
    from ..model_file import load_state_dict
    buffers = dict(named_buffers(model))
    elsewhere = _from_other_stages(dict.fromkeys(name for name, _ in named_buffers(model, stage_local_only=True)))
    params = {k: v for k, v in state.items() if k not in buffers and k not in elsewhere}
    load_state_dict(model, params, strict)
    with torch.no_grad():
        for name, buffer in buffers.items():
            if name in state:
                buffer.copy_(state[name])
            elif strict:
                raise _C.Error(f"load_state_dict: the buffer '{name}' is not in the dict")
    return torch.nn.modules.module._IncompatibleKeys([], [])


class Block(_block.Block):
    """BMTrain's Block (CheckpointBlock): the module's parameters in ZeRO buffers (level 2 or 3,
    ztrain also takes 0 and 1), its forward recomputed in backward when use_checkpoint.
    Attributes of the wrapped module read through the Block. mode="PIPE" marks a layer meant
    for a PipelineTransformerBlockList; it trains the same either way."""

    def __init__(self, inner_module, use_checkpoint=True, zero_level=3, initialized=False, mode="BLOCK"):
        _require_init("Block")
        if mode not in ("BLOCK", "PIPE"):
            raise _C.Error(f"Block(mode={mode!r}): \"BLOCK\" or \"PIPE\" (a layer of a PipelineTransformerBlockList)")
        super().__init__(inner_module, zero_level=zero_level, use_checkpoint=use_checkpoint)
        for p in inner_module.parameters():
            p._in_block = True

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if module is None:
                raise
            return getattr(module, name)


CheckpointBlock = Block


class TransformerBlockList(_block.BlockList):
    """BMTrain's TransformerBlockList: blocks in sequence, each gathering the next one's
    parameters while it computes. forward(*args): the first num_hidden arguments are the hidden
    states, replaced by each block's outputs; the others are passed to every block.
    return_hidden_states=True also returns each hidden state's inputs to the blocks, stacked."""

    def __init__(self, modules, num_hidden=1):
        super().__init__([m if isinstance(m, _block.Block) else Block(m) for m in modules])
        self.num_hidden = num_hidden

    def forward(self, *args, return_hidden_states=False):
        hidden_states = []
        outputs = args[:self.num_hidden]
        for block in self:
            if return_hidden_states:
                hidden_states.extend(args[:self.num_hidden])
            outputs = block(*args)
            if not isinstance(outputs, tuple):
                outputs = (outputs,)
            args = outputs + args[self.num_hidden:]
        if return_hidden_states:
            stacked = [torch.stack(hidden_states[i::self.num_hidden], dim=0) for i in range(self.num_hidden)]
            return tuple(outputs) + tuple(stacked)
        return tuple(outputs[:self.num_hidden]) if self.num_hidden > 1 else outputs[0]


class PipelineTransformerBlockList(_pipeline.PipelineBlockList):
    """BMTrain's PipelineTransformerBlockList: the layers cut over the pipeline stages as BMTrain
    cuts them, each stage keeping its own as Blocks (modules are wrapped at ZeRO level 2, as
    BMTrain's pipeline does; Blocks passed in keep their level). forward(hidden_state, *args,
    batch_related=[], return_hidden_states=False) takes this rank's part of the batch and returns
    this rank's part of the output (and every layer's input for it, stacked); the pipeline's
    batch is every stage's part, cut into config["micros"] micro-batches (ztrain.PipelineBlockList
    has the schedule). len() counts every layer; iteration and indexing reach this stage's."""

    def __init__(self, modules, num_hidden=1):
        _require_init("PipelineTransformerBlockList")
        if num_hidden != 1:
            raise _C.Error(f"PipelineTransformerBlockList(num_hidden={num_hidden}): a pipeline passes one hidden "
                           "state between stages, as BMTrain's")
        modules = list(modules)
        begin, end = _pipeline.stage_range(len(modules), config["topology"].stage_id, config["pipe_size"])
        mine = [m if isinstance(m, _block.Block) or not begin <= i < end else Block(m, zero_level=2)
                for i, m in enumerate(modules)]
        super().__init__(mine, micro_batches=config.get("micros"))
        self.num_hidden = num_hidden
        self.stages, self.stage_id = config["pipe_size"], config["topology"].stage_id
        self.layer_ids = range(self.begin, self.end)

    def forward(self, hidden_state, *args, batch_related=[], return_hidden_states=False):
        return super().forward(hidden_state, *args, batch_related=batch_related,
                               return_hidden_states=return_hidden_states)

    def get_range_by_stage_id(self, stage_id):
        return range(*_pipeline.stage_range(self.layers, stage_id, self.stages))

    def get_part_len_by_stage_id(self, stage_id):
        return len(self.get_range_by_stage_id(stage_id))

    def get_stage_by_layer_id(self, layer_id):
        return next(s for s in range(self.stages) if layer_id in self.get_range_by_stage_id(s))
