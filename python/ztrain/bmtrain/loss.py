"""BMTrain's FusedCrossEntropy: cross entropy computed in fp32 whatever the logits' dtype (the
loss is fp32; the gradient comes back in the logits' dtype).

parallel=True takes vocabulary-parallel logits: each tensor-parallel rank holds its slice of the
vocabulary (tp_rank × V/tp_size onwards, as bmt.nn.VPEmbedding(projection=True) gives them) and
the loss over the whole vocabulary is found without gathering the logits: the maximum, the sum of
exponentials and the target's logit are reduced over the tp group, and every tp rank gets the
same loss."""
import torch

from .. import _C
from ..nn import cross_entropy, vocab_parallel_losses


class FusedCrossEntropy(torch.nn.Module):
    def __init__(self, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, parallel=False):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise _C.Error(f"FusedCrossEntropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if parallel and label_smoothing:
            raise _C.Error("FusedCrossEntropy(parallel=True): label smoothing is not supported (nor is it in BMTrain)")
        self.weight = weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.parallel = parallel

    def forward(self, input, target):
        if not self.parallel:
            if (self.weight is None and self.reduction == "mean" and not self.label_smoothing and input.dim() == 2
                    and target.shape == input.shape[:1]):
                return cross_entropy(input, target, self.ignore_index)  # the fused kernel; 16-bit in float
            weight = None if self.weight is None else self.weight.float()
            return torch.nn.functional.cross_entropy(input.float(), target.long(), weight=weight,
                                                     ignore_index=self.ignore_index, reduction=self.reduction,
                                                     label_smoothing=self.label_smoothing)
        if input.dim() != 2 or target.shape != input.shape[:1]:
            raise _C.Error(f"FusedCrossEntropy(parallel=True): logits of (rows, vocabulary slice) and targets of "
                           f"(rows,), got {tuple(input.shape)} and {tuple(target.shape)}")
        target = target.long()
        loss = vocab_parallel_losses(input, target)
        ignored = target == self.ignore_index
        if self.weight is not None:
            w = self.weight.float()[torch.where(ignored, 0, target)].masked_fill(ignored, 0)
        else:
            w = (~ignored).float()
        loss = w * loss
        if self.reduction == "none":
            return loss
        if self.reduction == "sum":
            return loss.sum()
        return loss.sum() / w.sum()
