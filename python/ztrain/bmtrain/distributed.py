"""BMTrain's collectives (bmtrain.distributed) with its autograd rules, over ztrain's
communicators. `comm` names a group ("comm" and "zero_comm": every rank, "pp_zero_comm": every
rank of the pipeline stage, "tp_comm": tensor-parallel, "tp_zero_comm": the data-parallel ranks of
one tp_rank, "pp_tp_zero_comm": those of one stage, "pipe_comm": one rank per pipeline stage;
bmt.config holds these names); None is every rank. As in BMTrain, the backward of all_gather
keeps this rank's slice of the gradient and that of a sum all_reduce passes the gradient
through: the loss is taken to be replicated over the group."""
import torch

from .. import _C
from .. import pipeline as _pipeline
from .global_var import config

_GROUPS = {"comm": "world", "zero_comm": "world", "pp_zero_comm": "stage", "tp_zero_comm": "dp",
           "pp_tp_zero_comm": "dp", "tp_comm": "tp", "pipe_comm": "pp"}


def _group(comm):
    if comm is None:
        return "world"
    if comm in _GROUPS.values():
        return comm
    if comm in _GROUPS:
        return _GROUPS[comm]
    raise _C.Error(f"ztrain.bmtrain.distributed: unknown communicator {comm!r}; pass one of bmt.config's names "
                   f"({', '.join(sorted(_GROUPS))}) or None")


def _dense(x):
    return x.detach().contiguous().clone()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _C._all_gather(_dense(x), group).view((_C._group_size(group),) + tuple(x.shape))

    @staticmethod
    def backward(ctx, grad):
        return grad[_C._group_rank(ctx.group)], None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        size = _C._group_size(group)
        if x.shape[0] % size:
            raise _C.Error(f"reduce_scatter: dimension 0 ({x.shape[0]}) must divide by the group's {size} ranks")
        ctx.group, ctx.op = group, op
        return _C._reduce_scatter(_dense(x), op, group).view((x.shape[0] // size,) + tuple(x.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        if ctx.op not in ("sum", "avg"):
            raise _C.Error(f"reduce_scatter: the backward of '{ctx.op}' is not defined")
        full = _C._all_gather(_dense(grad), ctx.group).view((-1,) + tuple(grad.shape[1:]))
        return (full / _C._group_size(ctx.group) if ctx.op == "avg" else full), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        out = _dense(x)
        _C._all_reduce(out, op, group)
        ctx.group, ctx.op = group, op
        if op in ("max", "min"):
            ctx.save_for_backward(x != out)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.op == "sum":
            return grad, None, None
        if ctx.op == "avg":
            return grad / _C._group_size(ctx.group), None, None
        return torch.masked_fill(grad, ctx.saved_tensors[0], 0), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, root, group):
        out = _dense(x)
        _C._broadcast(out, root, group)
        ctx.root, ctx.group = root, group
        return out

    @staticmethod
    def backward(ctx, grad):
        total = _dense(grad)
        _C._all_reduce(total, "sum", ctx.group)
        return (total if _C._group_rank(ctx.group) == ctx.root else torch.zeros_like(grad)), None, None


def _require_init():
    if not config["initialized"]:
        raise _C.Error("ztrain.bmtrain is not initialized: call bmt.init_distributed() first")


def all_gather(x, comm=None):
    """(group size, *x.shape): every rank's x."""
    _require_init()
    return _AllGather.apply(x, _group(comm))


def reduce_scatter(x, op="sum", comm=None):
    """x of (group size × n, ...) reduced ("sum", "avg", "max", "min"); this rank keeps rows rank × n ..."""
    _require_init()
    return _ReduceScatter.apply(x, op, _group(comm))


def all_reduce(x, op="sum", comm=None):
    """x reduced over the group ("sum", "avg", "max", "min"), a new tensor."""
    _require_init()
    return _AllReduce.apply(x, op, _group(comm))


def broadcast(src, root, comm=None):
    """The root's `src` on every rank, a new tensor."""
    _require_init()
    return _Broadcast.apply(src, root, _group(comm))


def send_activations(hidden_state, next_rank, comm):
    """Sends a tensor (its shape and dtype first) to `next_rank` of `comm`, as BMTrain's."""
    _pipeline.send_activations(hidden_state, next_rank, _group(comm))


def recv_activations(prev_rank, comm):
    """The tensor `prev_rank` of `comm` sent with send_activations, on this rank's device."""
    return _pipeline.recv_activations(prev_rank, _group(comm))
