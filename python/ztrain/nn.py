"""Tensor-parallel linear layers for Python models, Megatron-LM's cut over the tensor-parallel
group of init_distributed(tp_size=...):

- ColumnParallelLinear: the weight's rows (the output features) split; the input is the same on
  every tp rank (its gradient summed over them in backward), the output this rank's part of the
  features, or all of them with gather_output=True.
- RowParallelLinear: the weight's columns (the input features) split; the input is this rank's
  part of the features (a column layer's output), the output summed over the tp ranks and the
  bias, kept whole on every rank, added once.

- VocabParallelEmbedding: the table's rows (the vocabulary) split; each rank looks up the tokens
  of its rows, the others give zeros, and the sum over the tp ranks is every token's vector.
  `logits(x)` projects onto this rank's rows (a head tied to the embedding): vocabulary-parallel
  logits, which vocab_parallel_cross_entropy turns into the loss over the whole vocabulary
  without gathering them (Megatron's, for large vocabularies).

A column layer followed by a row layer (an MLP; attention's projections with heads / tp_size
heads per rank) communicates once forward and once backward. Each layer holds this rank's slice
as a Parameter with `tp_split_dim` (0 for a column layer's weight and bias and an embedding's
table, 1 for a row layer's weight), which ztrain.Block, save, load, state_dict and init_parameters take as a slice of the
full tensor: files hold full tensors and load at any tp size. from_linear(linear) (from_embedding(embedding)) cuts an
existing torch.nn.Linear (Embedding) the same way on every rank (the Booster's HybridParallelPlugin does so by
policy); the constructors make this rank's slice of a freshly initialised full layer.

dropout, Dropout, gelu_tanh and cross_entropy are the GPT model's fused CPU kernels (models/fused.h)
for any Python model, each the torch function it names.
"""
import torch
import torch.nn.functional as F

from . import _C
from .parameter import DistributedParameter


def _tp():
    return _C._group_rank("tp"), _C._group_size("tp")


def _all_reduce(x):
    x = x.contiguous().clone()
    _C._all_reduce(x, "sum", "tp")
    return x


def _gather_last(x):
    """Every tp rank's x joined along the last dimension."""
    parts = _C._all_gather(x.contiguous(), "tp").view((_tp()[1],) + tuple(x.shape))
    return torch.cat(parts.unbind(0), dim=-1)


def _own_last(x):
    rank, size = _tp()
    return x.chunk(size, dim=-1)[rank].contiguous()


class _CopyToTp(torch.autograd.Function):
    """Identity; backward sums the gradient over the tp ranks (a replicated input used by each
    rank's part)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTp(torch.autograd.Function):
    """The sum over the tp ranks; backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherFromTp(torch.autograd.Function):
    """Every rank's part joined along the last dimension; backward keeps this rank's part."""

    @staticmethod
    def forward(ctx, x):
        return _gather_last(x)

    @staticmethod
    def backward(ctx, grad):
        return _own_last(grad)


def _value(p):
    """A layer's parameter as its forward uses it: the full slice of a DistributedParameter
    (HybridParallelPlugin makes one of a tensor-parallel layer outside its units), gathered once
    per forward however many layers share it."""
    return p.gather() if isinstance(p, DistributedParameter) else p


def _split(what, n, size):
    if n % size:
        raise _C.Error(f"{what} ({n}) does not divide by the {size} tensor-parallel ranks")
    return n // size


def _slice_parameter(full, dim):
    """This tp rank's chunk of `full` along `dim`, as a Parameter marked with its split."""
    rank, size = _tp()
    p = torch.nn.Parameter(full.detach().chunk(size, dim=dim)[rank].clone(), requires_grad=full.requires_grad)
    p.tp_split_dim = dim
    return p


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, gather_output=False, dtype=None, _dense=None):
        super().__init__()
        dense = _dense if _dense is not None else torch.nn.Linear(in_features, out_features, bias, dtype=dtype)
        size = _tp()[1]
        self.in_features = in_features
        self.out_features = out_features
        self.out_features_per_partition = _split("ColumnParallelLinear: out_features", out_features, size)
        self.gather_output = gather_output
        self.weight = _slice_parameter(dense.weight, 0)
        self.bias = _slice_parameter(dense.bias, 0) if dense.bias is not None else None

    @classmethod
    def from_linear(cls, linear, gather_output=False):
        """This rank's columns of `linear` (the same full layer on every rank)."""
        return cls(linear.in_features, linear.out_features, gather_output=gather_output, _dense=linear)

    def forward(self, x):
        y = F.linear(_CopyToTp.apply(x), _value(self.weight), _value(self.bias))
        return _GatherFromTp.apply(y) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features_per_partition} of "
                f"{self.out_features}, bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, dtype=None, _dense=None):
        super().__init__()
        dense = _dense if _dense is not None else torch.nn.Linear(in_features, out_features, bias, dtype=dtype)
        size = _tp()[1]
        self.in_features = in_features
        self.out_features = out_features
        self.in_features_per_partition = _split("RowParallelLinear: in_features", in_features, size)
        self.weight = _slice_parameter(dense.weight, 1)
        self.bias = torch.nn.Parameter(dense.bias.detach().clone()) if dense.bias is not None else None

    @classmethod
    def from_linear(cls, linear):
        """This rank's rows of `linear`'s input features (the same full layer on every rank)."""
        return cls(linear.in_features, linear.out_features, _dense=linear)

    def forward(self, x):
        if x.shape[-1] != self.in_features_per_partition:
            raise _C.Error(f"RowParallelLinear: takes this rank's {self.in_features_per_partition} of "
                           f"{self.in_features} input features (a column layer's output), got {x.shape[-1]}")
        y = _ReduceFromTp.apply(F.linear(x, _value(self.weight)))
        return y + _value(self.bias) if self.bias is not None else y

    def extra_repr(self):
        return (f"in_features={self.in_features_per_partition} of {self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, num_embeddings, embedding_dim, dtype=None, _dense=None):
        super().__init__()
        dense = _dense if _dense is not None else torch.nn.Embedding(num_embeddings, embedding_dim, dtype=dtype)
        rank, size = _tp()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = _split("VocabParallelEmbedding: num_embeddings", num_embeddings, size)
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.weight = _slice_parameter(dense.weight, 0)

    @classmethod
    def from_embedding(cls, embedding):
        """This rank's rows of `embedding` (the same full table on every rank)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise _C.Error("VocabParallelEmbedding.from_embedding: padding_idx, max_norm and sparse are not supported")
        return cls(embedding.num_embeddings, embedding.embedding_dim, _dense=embedding)

    def forward(self, ids):
        weight = _value(self.weight)
        if _tp()[1] == 1:
            return F.embedding(ids, weight)
        local = ids - self.vocab_start_index
        outside = (local < 0) | (local >= self.num_embeddings_per_partition)
        out = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0)
        return _ReduceFromTp.apply(out)

    def logits(self, x, gather_output=False):
        """x projected onto the table (a head tied to the embedding): this rank's vocabulary
        slice of the logits, or, gathered, all of them."""
        y = F.linear(_CopyToTp.apply(x), _value(self.weight))
        return _GatherFromTp.apply(y) if gather_output else y

    def extra_repr(self):
        return f"{self.num_embeddings_per_partition} of {self.num_embeddings}, {self.embedding_dim}"


def vocab_parallel_cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    """Cross entropy over the whole vocabulary of vocabulary-parallel logits (N, V / tp_size) —
    this rank's slice, tp_rank × V / tp_size onwards, as VocabParallelEmbedding.logits gives them —
    against targets (N,) in [0, V), without gathering the logits: the maximum, the sum of
    exponentials and the target's logit are reduced over the tp group. Computed in fp32; every tp
    rank gets the same loss ("mean" over the rows whose target is not ignore_index, "sum" or
    "none"), and the gradient of this rank's slice."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise _C.Error(f"vocab_parallel_cross_entropy: logits of (rows, vocabulary slice) and targets of (rows,), "
                       f"got {tuple(logits.shape)} and {tuple(target.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise _C.Error(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    losses = vocab_parallel_losses(logits, target.long())
    kept = (target != ignore_index).float()
    losses = losses * kept
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / kept.sum()


def vocab_parallel_losses(logits, target):
    """Each row's loss (targets outside the vocabulary, as ignored ones, give a finite value)."""
    rank, _ = _tp()
    local = logits.shape[-1]
    start = rank * local
    x = logits.float()
    peak = x.detach().max(dim=-1).values.contiguous()
    _C._all_reduce(peak, "max", "tp")
    shifted = x - peak[:, None]
    sum_exp = _ReduceFromTp.apply(shifted.exp().sum(dim=-1))
    here = (target >= start) & (target < start + local)
    index = (target - start).clamp(0, local - 1)
    picked = _ReduceFromTp.apply(shifted.gather(-1, index[:, None]).squeeze(-1) * here)
    return sum_exp.log() - picked


# The fused CPU kernels of the GPT model (models/fused.h), for Python models: each is the torch
# function it names where a kernel takes the input (float, and for dropout and GELU bf16, on the
# CPU) and the torch function itself elsewhere.

def dropout(input, p=0.5, training=True):
    """torch.nn.functional.dropout(input, p, training): on the CPU the mask comes from a
    counter-based generator (Philox4x32-10) in the pass that scales, and backward keeps only its
    seed, one draw from torch's default CPU generator (so torch.manual_seed and ztrain's
    recomputation govern it): 5.6× torch's speed forward and 2.8× forward and backward on an AVX2
    core (bench/fused_bench.py). The masks are not torch's."""
    return _C._dropout(input, float(p), bool(training))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, with the same arguments. Without a mask, for
    (batch, heads, tokens, head size) tensors, on the CPU in float: it works a block of 64 queries
    at a time and keeps only each query's log-sum-exp for backward, with the dropout of
    ztrain.nn.dropout applied to the probabilities inside the block (torch's CPU attention with
    dropout materialises them and draws with bernoulli_); under enable_gqa the key and value heads
    serve their groups of query heads in place. The output is then a view of a (batch, tokens,
    heads, head size) tensor. With attn_mask, or tensors of other ranks, it is torch's function,
    dropout included."""
    if attn_mask is not None or not query.dim() == key.dim() == value.dim() == 4:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _C._attention(query, key, value, float(dropout_p), bool(is_causal),
                         None if scale is None else float(scale), bool(enable_gqa))


class Dropout(torch.nn.Dropout):
    """torch.nn.Dropout through ztrain.nn.dropout (not in place)."""

    def __init__(self, p=0.5):
        super().__init__(p)

    def forward(self, input):
        return dropout(input, self.p, self.training)


def gelu_tanh(input):
    """torch.nn.functional.gelu(input, approximate="tanh") in one pass; agrees with torch's to a
    few float ulps."""
    return _C._gelu_tanh(input)


def cross_entropy(logits, target, ignore_index=-100):
    """torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index) with the mean
    reduction, for logits (N, V) and targets (N,): forward writes nothing of the logits' size,
    backward writes the gradient in one pass. Agrees with torch's to a few float ulps. 16-bit logits
    count as their float widening: the loss is a float, the gradient has the logits' type (bf16 on
    the CPU without a float copy)."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise _C.Error(f"cross_entropy: logits of (rows, classes) and targets of (rows,), "
                       f"got {tuple(logits.shape)} and {tuple(target.shape)}")
    return _C._cross_entropy(logits, target.long(), ignore_index)
