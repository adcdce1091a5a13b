"""PipelineBlockList: a model's layers split over the pipeline stages (init_distributed(pp_size=p)),
trained with every rank's code unchanged (BMTrain's PipelineTransformerBlockList, on which
ztrain.bmtrain builds its own).

    ztrain.init_distributed(pp_size=2)                         # mpirun -np 4: 2 stages x 2 dp
    layers = ztrain.PipelineBlockList([Layer() for _ in range(12)], micro_batches=4)
    h = layers(embed(ids), mask)      # each rank its own part of the batch, as under DDP
    loss = head(h, targets)           # this rank's part's output

Every rank builds every layer (in the same order); stage s keeps layers [a_s, b_s) — the layers
cut into p runs of equal length, the first ones one longer — as Blocks of `zero_level` over its
data-parallel group, and drops the others. Its children are named by their index in the whole
list ("0", "1", …), so save, load and init_parameters see the plain model's names across the
stages.

forward(x, *args) gathers the parts of x of the ranks of this rank's pipeline group (one rank per
stage, with the same data-parallel and tensor-parallel place) into one batch, cuts it into
`micro_batches` micro-batches and runs them through the stages (GPipe: each stage forwards the
micro-batches in turn, sending each to the next stage, and backward runs them in reverse; each
block's gradients are reduced over the data-parallel group once, after the last micro-batch's
backward), then hands each rank the output of its own part. Tensor arguments whose first
dimension is the batch and whose rank is x's (or those whose positions `batch_related` lists)
are gathered and cut the same way; other arguments are stage 0's, passed to every micro-batch.

Under Booster.execute_pipeline a schedule of the C++ engine (1F1B, GPipe, interleaved) drives
the stages instead, one micro-batch of the model's forward at a time (`micro_batch`): each stage
runs its blocks of one model chunk — with `chunks` = v, stage s holds the layer runs s, p + s, …
of p·v — and ends the model's forward there (StageDone) unless it holds the last run.

Parameters outside the pipeline (embeddings, the head) are held by every stage: their gradients
are summed over the stages once backward is done with them (`sum_over_stages`, which the
OptimManagers' clip_grad_norm, grad_norm and step and ztrain.optim's step call first), so that
they stay equal, and a global gradient norm counts them once.
"""
import pickle

import torch

from . import _C
from .block import Block
from .parameter import all_reduce_gradients

_backward_passes = 0  # backward passes through a pipeline so far (the same count on every rank)

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool]
_MAX_DIMS = 8


def stages():
    """The number of pipeline stages, and this rank's stage."""
    return _C._group_size("pp"), _C._group_rank("pp")


def _header(x, what):
    """x's dtype and shape as a fixed-size int64 tensor (an empty one for x None: to receive into)."""
    if x is None:
        return torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
    if x.dtype not in _DTYPES or x.dim() > _MAX_DIMS:
        raise _C.Error(f"{what}: {x.dtype} tensors of at most {_MAX_DIMS} dimensions, got {x.dtype} "
                       f"of shape {tuple(x.shape)}")
    return torch.tensor([_DTYPES.index(x.dtype), x.dim(), *x.shape] + [0] * (_MAX_DIMS - x.dim()), dtype=torch.int64)


def _empty_like_header(header, device):
    dims = int(header[1])
    return torch.empty([int(d) for d in header[2:2 + dims]], dtype=_DTYPES[int(header[0])], device=device)


def send_activations(x, stage, group="pp"):
    """Sends a tensor of any shape and dtype to `stage` of the pipeline group (its rank in
    `group`), which receives it with recv_activations."""
    x = x.detach().contiguous()
    _C._send(_header(x, "send_activations"), stage, group)
    _C._send(x, stage, group)


def recv_activations(stage, group="pp", device=None):
    """The tensor `stage` sent with send_activations."""
    header = _header(None, "recv_activations")
    _C._recv(header, stage, group)
    out = _empty_like_header(header, device or _C.device())
    _C._recv(out, stage, group)
    return out


def stage_objects(obj):
    """Every stage's `obj` (picklable), in stage order (collective over the pipeline group)."""
    size, stage = stages()
    out = []
    for root in range(size):
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if root == stage else None
        length = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
        _C._broadcast(length, root, "pp")
        if data is None:
            data = torch.empty(int(length), dtype=torch.uint8)
        _C._broadcast(data, root, "pp")
        out.append(obj if root == stage else pickle.loads(data.numpy().tobytes()))
    return out


def stage_local_names(model):
    """The names of `model`'s parameters that only this stage holds (its pipeline blocks')."""
    names = set()
    for path, m in model.named_modules():
        if isinstance(m, Block) and getattr(m, "_pipeline_stage", False):
            names.update(f"{path}.{name}" for name, _ in m.module.named_parameters())
    return names


def _gather_stages(x):
    """The pipeline group's parts of x, stage by stage, along dimension 0."""
    size, _ = stages()
    return _C._all_gather(x.contiguous(), "pp").view(size * x.shape[0], *x.shape[1:])


class _PipeIn(torch.autograd.Function):
    """This rank's part -> the pipeline group's batch. Only stage 0 computes on it, so its
    gradient is stage 0's, of which each rank takes its part."""

    @staticmethod
    def forward(ctx, x):
        return _gather_stages(x)

    @staticmethod
    def backward(ctx, grad):
        size, stage = stages()
        grad = grad.contiguous().clone()
        _C._broadcast(grad, 0, "pp")
        return grad.chunk(size)[stage].clone()


class _PipeOut(torch.autograd.Function):
    """The last stage's output of the whole batch -> this rank's part; backward gathers every
    rank's part of the gradient (the stages before the last discard their own outputs)."""

    @staticmethod
    def forward(ctx, y):
        size, stage = stages()
        last = stage == size - 1
        ctx.shape, ctx.last = y.shape, last
        header = _header(y if last else None, "PipelineBlockList")  # the last stage's output's shape
        _C._broadcast(header, size - 1, "pp")
        out = y.detach().clone() if last else _empty_like_header(header, y.device)
        _C._broadcast(out, size - 1, "pp")
        return out.chunk(size)[stage].clone()

    @staticmethod
    def backward(ctx, grad):
        count_backward_pass()
        whole = _gather_stages(grad)
        return whole if ctx.last else whole.new_zeros(()).expand(ctx.shape)


class _StageIn(torch.autograd.Function):
    """A micro-batch entering a stage after the first: received from the previous stage, its
    gradient sent back there."""

    @staticmethod
    def forward(ctx, x):
        _, stage = stages()
        return recv_activations(stage - 1, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        _, stage = stages()
        send_activations(grad, stage - 1)
        return None


class _StageOut(torch.autograd.Function):
    """A micro-batch leaving a stage before the last: sent to the next stage, its gradient
    received from there."""

    @staticmethod
    def forward(ctx, y):
        _, stage = stages()
        send_activations(y, stage + 1)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        _, stage = stages()
        return recv_activations(stage + 1, device=grad.device)


class _GatherLayerInputs(torch.autograd.Function):
    """This stage's layers' inputs (layers, pipeline batch, ...) -> every layer's input for this
    rank's part of the batch (all layers, part, ...): each stage in turn hands its inputs to the
    others; backward gathers each stage's layers' gradients over the parts back to it."""

    @staticmethod
    def forward(ctx, local, counts):
        size, stage = stages()
        ctx.counts = counts
        parts = []
        for root, count in enumerate(counts):
            held = local.detach().contiguous() if root == stage else local.new_empty((count,) + local.shape[1:])
            _C._broadcast(held, root, "pp")
            parts.append(held.chunk(size, dim=1)[stage])
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        size, stage = stages()
        mine = None
        for root, g in enumerate(grad.split(ctx.counts)):
            whole = torch.cat(_C._all_gather(g.contiguous(), "pp").view((size,) + g.shape).unbind(0), dim=1)
            if root == stage:
                mine = whole
        return mine, None


class _ReduceOnce(torch.autograd.Function):
    """Placed after a block's output for each micro-batch: its backward runs just before the
    block's, turning the block's gradient reduction off for every micro-batch but the first,
    whose backward comes last, so that the micro-batches' gradients are reduced once, summed
    (as no_sync does; a reduction already off stays off)."""

    @staticmethod
    def forward(ctx, h, native, last):
        ctx.native, ctx.last = native, last
        ctx.sync = native.gradient_sync()
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        ctx.native.set_gradient_sync(ctx.sync if ctx.last else False)
        return grad, None, None


def stage_range(layers, stage, size):
    """The layers [begin, end) of `stage`: equal runs, the first layers % size one longer."""
    base, extra = divmod(layers, size)
    begin = stage * base + min(stage, extra)
    return begin, begin + base + (stage < extra)


def sum_over_stages(params):
    """Sums over the pipeline stages the gradients of those of `params` that every stage holds
    (all but the shards of pipeline blocks) and that backward passes through a pipeline have
    added to since they were last summed: once after all of a step's backward passes (gradient
    accumulation, no_sync), before the gradients are read. Collective, on every rank alike."""
    size, _ = stages()
    if size == 1:
        return
    held = [p for p in params if p.requires_grad and not getattr(p, "_pipeline_stage", False)
            and getattr(p, "_summed_at", 0) < _backward_passes]  # the same list on every stage
    for p in held:
        p._summed_at = _backward_passes
    all_reduce_gradients(held, "sum", "pp")


def data_parallel():
    """(index, count) of this rank among the ranks that take different data: the dp ranks of
    every pipeline stage (each stage's rank brings its own part of its pipeline's batch);
    the tp ranks of one place share theirs."""
    size, stage = stages()
    dp = _C._group_size("dp")
    return stage * dp + _C._group_rank("dp"), size * dp


def micro_batch_args(args, batch, dims, micro_batches, batch_related):
    """Each micro-batch's arguments: the batch-related tensors gathered over the stages and cut,
    the other tensors stage 0's, the rest as they are."""
    out = [[] for _ in range(micro_batches)]
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                raise _C.Error(f"PipelineBlockList: argument {i + 1} requires a gradient; pass what the layers "
                               "differentiate as the hidden state, or detach it")
            related = (i in batch_related) if batch_related else (a.dim() == dims and a.shape[0] == batch)
            if related:
                parts = _gather_stages(a).chunk(micro_batches)
            else:
                a = a.contiguous().clone()
                _C._broadcast(a, 0, "pp")
                parts = [a] * micro_batches
        else:
            parts = [a] * micro_batches
        for m in range(micro_batches):
            out[m].append(parts[m])
    return out


def count_backward_pass():
    """Records a backward pass through a pipeline (one step's graph, or a schedule's
    micro-batches): the gradients of the parameters outside the pipeline are summed over the
    stages before they are next read (sum_over_stages)."""
    global _backward_passes
    _backward_passes += 1


class StageDone(Exception):
    """Raised by a PipelineBlockList running one micro-batch of a schedule on a stage before the
    last: its output goes to the next stage, and the rest of the model's forward is not run here."""


class MicroBatch:
    """One micro-batch through one of this stage's model chunks, as a schedule runs it: the
    activation received from the previous virtual stage (None on the first, which takes the
    model's own), and the chunk's output."""

    def __init__(self, received, chunk=0):
        self.received = received
        self.chunk = chunk
        self.output = None


class PipelineBlockList(torch.nn.Module):
    def __init__(self, modules, zero_level=2, use_checkpoint=True, micro_batches=None, prefetch_depth=1, chunks=1):
        super().__init__()
        size, stage = stages()
        modules = list(modules)
        if chunks < 1:
            raise _C.Error(f"PipelineBlockList: chunks must be >= 1, got {chunks}")
        if len(modules) < size * chunks:
            raise _C.Error(f"PipelineBlockList: {len(modules)} layers cannot fill {size} pipeline stages"
                           + (f" of {chunks} model chunks each" if chunks > 1 else ""))
        if len({id(m) for m in modules}) != len(modules):
            raise _C.Error("PipelineBlockList: a layer appears twice; build one module per layer")
        self.micro_batches = size if micro_batches is None else int(micro_batches)
        if self.micro_batches < 1:
            raise _C.Error(f"PipelineBlockList: micro_batches must be >= 1, got {micro_batches}")
        self.layers = len(modules)
        self.chunks = chunks
        # Chunk c of stage s is virtual stage c * size + s (Megatron-LM's interleaved layout).
        self.ranges = [stage_range(len(modules), c * size + stage, size * chunks) for c in range(chunks)]
        self.begin, self.end = self.ranges[0][0], self.ranges[-1][1]
        blocks = []
        for index in (i for begin, end in self.ranges for i in range(begin, end)):
            m = modules[index]
            block = m if isinstance(m, Block) else Block(m, zero_level, use_checkpoint)
            block._native.set_tied_copies(1)  # this stage's alone
            block._pipeline_stage = True
            for shard in block.parameters():
                shard._pipeline_stage = True
            self.add_module(str(index), block)
            blocks.append(block)
        _C._link_blocks([b._native for b in blocks], prefetch_depth)
        self.micro_batch = None  # set while a schedule runs one micro-batch (Booster.execute_pipeline)

    def __len__(self):
        """The layers of the whole pipeline."""
        return self.layers

    def __iter__(self):
        """This stage's blocks."""
        return iter(self._modules.values())

    def __getitem__(self, index):
        index = int(index) + (self.layers if int(index) < 0 else 0)
        if str(index) not in self._modules:
            held = ", ".join(f"{begin}..{end - 1}" for begin, end in self.ranges)
            raise _C.Error(f"PipelineBlockList: layer {index} is on another pipeline stage (this one holds {held})")
        return self._modules[str(index)]

    def forward(self, x, *args, batch_related=(), return_hidden_states=False):
        """This rank's part of the output; with return_hidden_states also every layer's input
        for this part, stacked (layers, part, ...)."""
        size, stage = stages()
        if self.micro_batch is not None:
            return self._forward_stage(x, args, return_hidden_states)
        if self.chunks > 1:
            raise _C.Error(f"PipelineBlockList: with {self.chunks} model chunks per stage the pipeline runs under "
                           "Booster.execute_pipeline (pp_style='interleaved'), not by calling the model on each "
                           "rank's part")
        if size * x.shape[0] % self.micro_batches:
            raise _C.Error(f"PipelineBlockList: the pipeline's batch ({size} stages x {x.shape[0]}) does not "
                           f"divide into {self.micro_batches} micro-batches")
        micro_args = micro_batch_args(args, x.shape[0], x.dim(), self.micro_batches, batch_related)
        if torch.is_grad_enabled() and not x.requires_grad and x.is_floating_point():
            x = x.detach().requires_grad_()  # so that every stage's micro-batches take part in backward
        outputs, inputs = [], []
        grad = torch.is_grad_enabled() and self.micro_batches > 1
        for index, (micro, margs) in enumerate(zip(_PipeIn.apply(x).chunk(self.micro_batches), micro_args)):
            h = _StageIn.apply(micro) if stage > 0 else micro
            for block in self._modules.values():
                if return_hidden_states:
                    inputs.append(h)
                h = block(h, *margs)
                if not isinstance(h, torch.Tensor):
                    raise _C.Error("PipelineBlockList: each block must return one tensor to pass on")
                if grad and h.requires_grad:
                    h = _ReduceOnce.apply(h, block._native, index == 0)
            outputs.append(_StageOut.apply(h) if stage < size - 1 else h)
        out = _PipeOut.apply(torch.cat(outputs))
        if not return_hidden_states:
            return out
        layers = self.end - self.begin
        local = torch.cat([torch.stack(inputs[m * layers:(m + 1) * layers]) for m in range(self.micro_batches)], dim=1)
        counts = [end - begin for begin, end in (stage_range(self.layers, s, size) for s in range(size))]
        return out, _GatherLayerInputs.apply(local, counts)

    def _forward_stage(self, x, args, return_hidden_states):
        """This stage's blocks on one micro-batch of a schedule: the previous stage's activation
        (or x on the first stage) in; before the last stage, the output kept for the schedule
        to send and the model's forward ended (StageDone)."""
        if return_hidden_states:
            raise _C.Error("PipelineBlockList: return_hidden_states is not available under a pipeline schedule "
                           "(Booster.execute_pipeline); call the model on each rank's part instead")
        size, stage = stages()
        chunk = self.micro_batch.chunk
        virtual = chunk * size + stage
        h = self.micro_batch.received if virtual > 0 else x
        begin, end = self.ranges[chunk]
        for index in range(begin, end):
            h = self._modules[str(index)](h, *args)
            if not isinstance(h, torch.Tensor):
                raise _C.Error("PipelineBlockList: each block must return one tensor to pass on")
        self.micro_batch.output = h
        if virtual < size * self.chunks - 1:
            raise StageDone()
        return h


__all__ = ["PipelineBlockList", "send_activations", "recv_activations", "sum_over_stages", "stage_range",
           "data_parallel"]
