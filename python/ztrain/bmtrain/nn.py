"""BMTrain's layers (bmtrain.nn). Linear holds DistributedParameters (xavier-normal weight, zero
bias). The tensor-parallel layers take BMTrain's arguments and compute what BMTrain's do over the
tensor-parallel group (config["tp_comm"]), with gradients exact for their forward:

- ColumnParallelLinear: the weight's rows split over the tp ranks (out_features / tp_size here).
  gather_input=True (the default) gathers the input of every tp rank first and stacks them along
  dimension 0 (BMTrain's sequence-parallel use: each tp rank holds a part of the sequence).
  gather_output=True joins the ranks' outputs along the last dimension.
- RowParallelLinear: the weight's columns split; the output is summed over the tp ranks and, by
  default, scattered along dimension 0 (the inverse of a column layer's gather_input), or kept
  whole on every rank (all_reduce_output=True). split_input=True takes this rank's part of the
  last dimension of a replicated input.
- VPEmbedding: the table's rows (the vocabulary) split; forward(ids) looks the ids up in the whole
  table, forward(h, projection=True) gathers h over the tp ranks (as a column layer's input) and
  gives this rank's vocabulary slice of the logits, for loss.FusedCrossEntropy(parallel=True).
- OpParallelLinear.apply(input, weight, bias, gather_input, gather_output, split_input,
  reduce_output_type, async_gather_chunks): the function under them. BMTrain overlaps chunks of
  the gathers with the matmuls on CUDA streams (async_gather_chunks); here each collective runs
  once over the whole tensor, with the same result.

On a CPU without native fp16 (bf16) matrix kernels these layers multiply in fp32 and round the
products (ztrain.bmtrain.placement says why), whether or not the placement mode is on.

Where BMTrain's gradients lose a part — the embedding's lookup keeps only this rank's tokens'
contribution to its vocabulary slice, a row-parallel layer's bias gets different gradients on
each tp rank, split_input's input gradient has the wrong shape — these layers give the whole
gradient (docs/python.md).
"""
import enum

import torch
import torch.nn.functional as F

from .. import _C
from ..nn import _all_reduce, _gather_last, _tp
from .distributed import all_gather
from .global_var import config
from .layer import DistributedModule, DistributedParameter, ParameterInitializer
from .placement import widened


def _linear(x, weight, bias=None):
    if widened(x):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def _mm(a, b):
    return (a.float() @ b.float()).to(a.dtype) if widened(a) else a @ b


class Linear(DistributedModule):
    def __init__(self, in_features, out_features, bias=True, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = DistributedParameter(torch.empty(out_features, in_features, dtype=dtype),
                                           init_method=torch.nn.init.xavier_normal_)
        if bias:
            self.bias = DistributedParameter(torch.empty(out_features, dtype=dtype), init_method=torch.nn.init.zeros_)
        else:
            self.register_parameter("bias", None)

    def forward(self, input):
        return _linear(input, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class OpLinear(torch.autograd.Function):
    """BMTrain's OpLinear: apply(x, weight, bias=None) is F.linear with a backward of its own."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad = _rows(grad_output)
        return (_mm(grad_output, weight) if ctx.needs_input_grad[0] else None,
                _mm(grad.t(), _rows(x)) if ctx.needs_input_grad[1] else None,
                grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None)


class ReduceType(enum.Enum):
    ALL_REDUCE = 1
    REDUCE_SCATTER = 2


def _gather_rows(x):
    """Every tp rank's x stacked along dimension 0 (x of shape (n, ...) gives (tp_size × n, ...))."""
    x = x.contiguous()
    return _C._all_gather(x, "tp").view((-1,) + tuple(x.shape[1:]))


def _scatter_rows(x):
    """x summed over the tp ranks, this rank's 1/tp_size of dimension 0."""
    rank, size = _tp()
    if x.shape[0] % size:
        raise _C.Error(f"tensor-parallel reduce-scatter: dimension 0 ({x.shape[0]}) does not divide by the "
                       f"{size} tensor-parallel ranks")
    return _C._reduce_scatter(x.contiguous(), "sum", "tp").view((x.shape[0] // size,) + tuple(x.shape[1:]))


def _rows(x):
    """x as a matrix of its last dimension."""
    return x.reshape(-1, x.shape[-1])


class OpParallelLinear(torch.autograd.Function):
    """BMTrain's tensor-parallel linear function (see the module's docstring)."""

    @staticmethod
    def forward(ctx, input, weight, bias=None, gather_input=False, gather_output=False, split_input=False,
                reduce_output_type=None, async_gather_chunks=2):
        if reduce_output_type is not None:
            reduce_output_type = ReduceType(reduce_output_type)
        if gather_output and reduce_output_type is not None:
            raise _C.Error("OpParallelLinear: gather_output and reduce_output_type exclude each other")
        full_input = input
        if gather_input:
            full_input = _gather_rows(full_input)
        if split_input:
            rank, size = _tp()
            if full_input.shape[-1] % size:
                raise _C.Error(f"OpParallelLinear(split_input=True): the input's last dimension "
                               f"({full_input.shape[-1]}) does not divide by the {size} tensor-parallel ranks")
            full_input = full_input.chunk(size, dim=-1)[rank]
        out = _linear(full_input, weight, bias)
        if gather_output:
            out = _gather_last(out)
        elif reduce_output_type == ReduceType.ALL_REDUCE:
            out = _all_reduce(out)
        elif reduce_output_type == ReduceType.REDUCE_SCATTER:
            shape = list(out.shape)
            if shape[0] % _tp()[1]:
                raise _C.Error(f"OpParallelLinear: the output's dimension 0 ({shape[0]}) does not divide by the "
                               f"{_tp()[1]} tensor-parallel ranks it is scattered over")
            shape[0] //= _tp()[1]
            out = _scatter_rows(_rows(out)).view(shape)
        ctx.options = (gather_input, gather_output, split_input, reduce_output_type)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(full_input, weight)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        gather_input, gather_output, split_input, reduce_output_type = ctx.options
        full_input, weight = ctx.saved_tensors
        grad = grad_output
        if reduce_output_type == ReduceType.REDUCE_SCATTER:
            grad = _gather_rows(_rows(grad))
        elif gather_output:
            rank, size = _tp()
            grad = grad.chunk(size, dim=-1)[rank]
        grad = _rows(grad)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = _mm(grad, weight).view(tuple(full_input.shape[:-1]) + (weight.shape[-1],))
            if split_input:
                grad_input = _gather_last(grad_input)
            if gather_input:
                grad_input = _scatter_rows(grad_input)
            elif reduce_output_type is None and not split_input:
                # A replicated input whose output stays split: every tp rank's part adds up.
                grad_input = _all_reduce(grad_input)
        if ctx.needs_input_grad[1]:
            grad_weight = _mm(grad.t(), _rows(full_input))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _tp_size(what, n):
    size = config["tp_size"]
    if n % size:
        raise _C.Error(f"{what} ({n}) does not divide by tp_size {size}")
    return size


class ColumnParallelLinear(DistributedModule):
    def __init__(self, in_features, out_features, bias=True, dtype=None, gather_output=False, gather_input=True,
                 async_gather_chunks=2):
        super().__init__()
        size = _tp_size("ColumnParallelLinear: out_features", out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_per_partition = out_features // size
        self.gather_output = gather_output
        self.gather_input = gather_input
        self.async_gather_chunks = async_gather_chunks
        self.weight = DistributedParameter(torch.empty(self.out_features_per_partition, in_features, dtype=dtype),
                                           init_method=torch.nn.init.xavier_normal_, tp_split_dim=0, tp_mode=True)
        if bias:
            self.bias = DistributedParameter(torch.empty(self.out_features_per_partition, dtype=dtype),
                                             init_method=torch.nn.init.zeros_, tp_split_dim=0, tp_mode=True)
        else:
            self.register_parameter("bias", None)

    def forward(self, input):
        return OpParallelLinear.apply(input, self.weight, self.bias, self.gather_input, self.gather_output, False,
                                      None, self.async_gather_chunks)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features_per_partition}, "
                f"bias={self.bias is not None}")


class RowParallelLinear(DistributedModule):
    def __init__(self, in_features, out_features, bias=True, dtype=None, split_input=False, all_reduce_output=False,
                 async_chunks=2):
        super().__init__()
        size = _tp_size("RowParallelLinear: in_features", in_features)
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_per_partition = in_features // size
        self.split_input = split_input
        self.all_reduce_output = all_reduce_output
        self.async_chunks = async_chunks
        self.weight = DistributedParameter(torch.empty(out_features, self.in_features_per_partition, dtype=dtype),
                                           init_method=torch.nn.init.xavier_normal_, tp_split_dim=1, tp_mode=True)
        if bias:
            self.bias = DistributedParameter(torch.empty(out_features, dtype=dtype), init_method=torch.nn.init.zeros_,
                                             tp_split_dim=-1, tp_mode=True)
        else:
            self.register_parameter("bias", None)

    def forward(self, input):
        reduce = ReduceType.ALL_REDUCE if self.all_reduce_output else ReduceType.REDUCE_SCATTER
        out = OpParallelLinear.apply(input, self.weight, None, False, False, self.split_input, reduce,
                                     self.async_chunks)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self):
        return (f"in_features={self.in_features_per_partition}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class _GatherTable(torch.autograd.Function):
    """Every tp rank's rows of a table, joined; the gradient of the whole table summed over the
    tp ranks comes back as this rank's rows."""

    @staticmethod
    def forward(ctx, table):
        return _gather_rows(table)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_rows(grad)


class VPEmbedding(DistributedModule):
    """BMTrain's vocabulary-parallel embedding (see the module's docstring)."""

    def __init__(self, vocab_size, embedding_size, dtype=torch.half, init_mean=0.0, init_std=1):
        super().__init__()
        size = _tp_size("VPEmbedding: vocab_size", vocab_size)
        self.dim_model = embedding_size
        self.vocab_size = vocab_size
        self.vocab_size_per_partition = vocab_size // size
        self.start_index = config["tp_rank"] * self.vocab_size_per_partition
        self.end_index = self.start_index + self.vocab_size_per_partition
        self.weight = DistributedParameter(torch.empty(self.vocab_size_per_partition, embedding_size, dtype=dtype),
                                           init_method=ParameterInitializer(torch.nn.init.normal_, mean=init_mean,
                                                                            std=init_std),
                                           tp_split_dim=0, tp_mode=True)

    def forward(self, x, projection=False):
        weight = self.weight
        if not projection:
            return F.embedding(x, _GatherTable.apply(weight) if config["tp_size"] > 1 else weight)
        if config["tp_size"] > 1:
            x = all_gather(x, "tp_comm").view(x.shape[0], -1, x.shape[-1])
        return OpParallelLinear.apply(x, weight, None, False, False, False, None, 1)
