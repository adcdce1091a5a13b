"""BMTrain's FusedCrossEntropy: cross entropy computed in fp32 whatever the logits' dtype (the
loss is fp32; the gradient comes back in the logits' dtype)."""
import torch

from .. import _C
from .global_var import config


class FusedCrossEntropy(torch.nn.Module):
    def __init__(self, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, parallel=False):
        super().__init__()
        if parallel and config.get("tp_size", 1) > 1:
            raise _C.Error("FusedCrossEntropy(parallel=True): vocabulary-parallel logits need tp_size > 1, which "
                           "ztrain.bmtrain does not run yet")
        self.weight = weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.parallel = parallel

    def forward(self, input, target):
        weight = None if self.weight is None else self.weight.float()
        return torch.nn.functional.cross_entropy(input.float(), target.long(), weight=weight,
                                                 ignore_index=self.ignore_index, reduction=self.reduction,
                                                 label_smoothing=self.label_smoothing)
