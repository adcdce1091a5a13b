"""BMTrain's layers (bmtrain.nn). Linear holds DistributedParameters (xavier-normal weight, zero
bias). The tensor-parallel names take BMTrain's arguments and, at tp_size 1 (the only size
ztrain.bmtrain runs), are the layers they reduce to: a Linear, an embedding."""
import torch
import torch.nn.functional as F

from .layer import DistributedModule, DistributedParameter, ParameterInitializer


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
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ColumnParallelLinear(Linear):
    def __init__(self, in_features, out_features, bias=True, dtype=None, gather_output=False, gather_input=True,
                 async_gather_chunks=2):
        super().__init__(in_features, out_features, bias, dtype)


class RowParallelLinear(Linear):
    def __init__(self, in_features, out_features, bias=True, dtype=None, split_input=False, all_reduce_output=False,
                 async_chunks=2):
        super().__init__(in_features, out_features, bias, dtype)


class VPEmbedding(DistributedModule):
    """BMTrain's vocabulary-parallel embedding: forward(ids) looks rows up; forward(h,
    projection=True) multiplies by the transposed table (the tied output head)."""

    def __init__(self, vocab_size, embedding_size, dtype=torch.half, init_mean=0.0, init_std=1):
        super().__init__()
        self.dim_model = embedding_size
        self.vocab_size = vocab_size
        self.weight = DistributedParameter(torch.empty(vocab_size, embedding_size, dtype=dtype),
                                           init_method=ParameterInitializer(torch.nn.init.normal_, mean=init_mean,
                                                                            std=init_std))

    def forward(self, x, projection=False):
        if projection:
            return F.linear(x, self.weight)
        return F.embedding(x, self.weight)
