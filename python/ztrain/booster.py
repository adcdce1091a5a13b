"""Booster: one training loop, the parallelism chosen by a plugin (the C++ Booster's, in
ColossalAI's shape) for Python models.

    model = GPT(config)                                          # a plain torch.nn.Module
    optimizer = ztrain.optim.AdamW(model.parameters(), lr=3e-4)
    booster = ztrain.booster.Booster(ztrain.booster.FullyShardPlugin(), max_grad_norm=1.0)
    model, optimizer, *_ = booster.boost(model, optimizer)      # collective
    for x, y in loader:                                          # each rank its own batches
        optimizer.zero_grad()
        booster.backward(loss_fn(model(x), y), optimizer)
        optimizer.step()                  # clipped; skipped on every rank if one saw inf/NaN
    booster.save_model(model, "model.safetensors")               # any plugin, world size
    booster.save_optimizer(optimizer, "optim.safetensors")       #   and level loads them

Plugins say how far the ranks split the model (ZeRO's stages; every plugin averages gradients
over the data-parallel group, as DDP does):

- DataParallelPlugin(): every rank keeps everything; gradients all-reduced while backward runs
  (ZeRO level 0, as DDP).
- LowLevelZeroPlugin(stage=1|2): the optimizer state (1) and the gradients (2) sharded over the
  ranks (ColossalAI's LowLevelZeroPlugin, ZeRO levels 1 and 2).
- FullyShardPlugin(use_checkpoint=False): the parameters too, gathered per unit around its
  forward and backward, the next unit's gather overlapping this one's compute (ZeRO-3, FSDP).
- HybridParallelPlugin(tp_size, tensor_parallel, zero_stage=0, pp_size=1): the Linear and
  Embedding layers a policy names split over the tensor-parallel ranks (ztrain.nn), the layer
  list cut over pipeline stages, then any of the above over the data-parallel ranks.

Each plugin wraps the model's *units* — by default every module held in a torch.nn.ModuleList
(the layer stacks of transformer models); `wrap` takes module classes instead (FSDP's
ModuleWrapPolicy) or a callable (name, module) -> bool — in a ztrain.Block of its level, in place,
and links the units of one list for prefetch. Parameters outside the units (embeddings, final
norms, a head tied to the embedding) stay plain tensors, broadcast from rank 0 at boost() and
replicated; their gradients are averaged over the data-parallel group when backward ends (one
all-reduce per dtype; a parameter without a gradient counts as zero), and the optimizer updates
them on every rank alike. A unit is called with its tensors positionally and returns a tensor or
a tuple of tensors (ztrain.Block's contract); no parameter may be shared between a unit and
anything else.

boost() keeps the caller's optimizer object (a ztrain.optim AdamW or Adam over the model's
parameters, not yet stepped): it now updates the units' shards and the other parameters, and an
LR scheduler built on it goes on working. Param groups carry over: a unit keeps its weights
(two or more dimensions) in shards apart from its biases and norm weights, so the usual
weight-decay split, and groups per unit, hold; a group that splits a unit otherwise is refused. It returns a wrapper whose
step() clips the global gradient norm (max_grad_norm) and steps through
ztrain.optim.OptimManager (loss scaling, the step skipped everywhere on an overflow); step the
scheduler after it as usual. Every rank makes the same calls in the same order.
"""
import contextlib
import re

import torch

from . import _C
from .block import Block, no_sync as _block_no_sync
from .pipeline import MicroBatch, PipelineBlockList, StageDone, count_backward_pass, stages
from .checkpoint import load_checkpoint, save_checkpoint
from .model_file import load, load_optimizer, save, save_optimizer
from .optim import AdamOffload, OptimManager, _NativeAdam
from .parameter import DistributedParameter, all_reduce_gradients


class Plugin:
    """Wraps a model's units in Blocks of one ZeRO level (the plugins below)."""

    def __init__(self, zero_level, wrap=None, use_checkpoint=False, prefetch_depth=1, offload_dir=None):
        if isinstance(wrap, type):
            wrap = (wrap,)
        if wrap is not None and not callable(wrap) and not (
                isinstance(wrap, tuple) and all(isinstance(c, type) for c in wrap)):
            raise _C.Error(f"{type(self).__name__}: wrap takes module classes or a callable (name, module) -> bool, "
                           f"got {wrap!r}")
        self.zero_level = zero_level
        self.wrap = wrap
        self.use_checkpoint = use_checkpoint
        self.prefetch_depth = prefetch_depth
        self.offload_dir = offload_dir  # the units' parameter and gradient shards in files there (levels 2, 3)
        self.replaced = {}  # id(a parameter configure made) -> the model's parameter it stands for

    def _is_unit(self, name, module, parent):
        if self.wrap is None:
            return isinstance(parent, torch.nn.ModuleList) and any(True for _ in module.parameters())
        if isinstance(self.wrap, tuple):
            return isinstance(module, self.wrap)
        return bool(self.wrap(name, module))

    def configure(self, model):
        """Wraps `model`'s units in place (collective); returns their names."""
        return self._wrap(model, self._units(model))

    def _wrap(self, model, units):
        self._check_unshared(model, units)
        lists = {}
        for name, parent, attribute, module in units:
            block = Block(module, self.zero_level, self.use_checkpoint, self.offload_dir)
            setattr(parent, attribute, block)
            lists.setdefault(id(parent), []).append(block)
        for blocks in lists.values():
            _C._link_blocks([b._native for b in blocks], self.prefetch_depth)
        return [name for name, _, _, _ in units]

    def _check_unshared(self, model, units):
        owner = {}
        for name, _, _, module in units:
            for p in module.parameters():
                owner[id(p)] = name
        for name, p in model.named_parameters(remove_duplicate=False):
            unit = owner.get(id(p))
            if unit is not None and not (name == unit or name.startswith(unit + ".")):
                raise _C.Error(f"{type(self).__name__}: the parameter '{name}' is shared with the unit '{unit}'; "
                               "a unit's parameters are sharded with it and cannot be used outside it")

    def _units(self, model):
        """(name, parent, attribute, module) of each unit of `model`, outermost first."""
        units = []

        def visit(prefix, parent):
            for attribute, child in parent.named_children():
                name = prefix + attribute
                if isinstance(child, Block):
                    raise _C.Error(f"{type(self).__name__}: '{name}' is a ztrain.Block already; boost a plain model")
                if self._is_unit(name, child, parent):
                    units.append((name, parent, attribute, child))
                else:
                    visit(name + ".", child)

        visit("", model)
        if not units:
            raise _C.Error(f"{type(self).__name__}: found no unit to wrap in {type(model).__name__} (by default the "
                           "modules of a torch.nn.ModuleList); pass wrap=(LayerClass,) or wrap=lambda name, module: ...")
        return units


class DataParallelPlugin(Plugin):
    """Replicas with gradients all-reduced while backward runs (DDP; ZeRO level 0)."""

    def __init__(self, wrap=None):
        super().__init__(0, wrap)


class LowLevelZeroPlugin(Plugin):
    """Optimizer state (stage 1) and gradients (stage 2) sharded over the data-parallel ranks."""

    def __init__(self, stage=2, wrap=None):
        if stage not in (1, 2):
            raise _C.Error(f"LowLevelZeroPlugin: stage must be 1 or 2, got {stage!r} (stage 3: FullyShardPlugin)")
        super().__init__(stage, wrap)
        self.stage = stage


class FullyShardPlugin(Plugin):
    """Parameters, gradients and optimizer state sharded; each unit's parameters gathered around
    its forward and backward (ZeRO-3, FSDP), with recomputation if use_checkpoint; with
    offload_dir, the units' parameter and gradient shards live in files there (ZeRO-Infinity's
    parameter offload; with AdamOffload(state_dir=...) the whole model state is on disk)."""

    def __init__(self, wrap=None, use_checkpoint=False, prefetch_depth=1, offload_dir=None):
        super().__init__(3, wrap, use_checkpoint, prefetch_depth, offload_dir)


class HybridParallelPlugin(Plugin):
    """Tensor parallelism by a policy, pipeline stages, then any ZeRO level over the
    data-parallel ranks (ColossalAI's HybridParallelPlugin).

        ztrain.init_distributed(tp_size=2)                       # 4 ranks: tp 2 × dp 2
        plugin = HybridParallelPlugin(tp_size=2, zero_stage=1, tensor_parallel={
            "layers.*.attn.q": "column", "layers.*.attn.k": "column", "layers.*.attn.v": "column",
            "layers.*.attn.o": "row", "layers.*.fc1": "column", "layers.*.fc2": "row"},
            adapt=lambda model, tp: [setattr(l.attn, "heads", l.attn.heads // tp) for l in model.layers])

    `tensor_parallel` maps module paths (`*` stands for one component of a name) to how the
    layer there splits: a torch.nn.Linear "column", "column_gathered" (its output joined on every
    rank) or "row" (ztrain.nn's Megatron cut: a column layer followed by a row layer communicates
    once each way), a torch.nn.Embedding "vocab" (ztrain.nn.VocabParallelEmbedding: its rows
    split, every token's vector summed over the tp ranks). Every rule must match a layer;
    `adapt(model, tp_size)` then fixes what the model's forward derives from the split sizes
    (heads per rank). The model's parameters are first broadcast from rank 0, so every rank cuts
    the same full layers. zero_stage 0-3 is the ZeRO level of the units over the dp group.

    A layer outside the units (the embedding, the head) keeps its slices as
    ztrain.DistributedParameters of zero_stage over the dp group, so that files hold full
    tensors. A head tied to the embedding — a Linear sharing the Embedding's weight, as Hugging
    Face's lm_head does — stays tied when both have rules that cut the weight's rows ("vocab" and
    "column" or "column_gathered"): one slice, gathered once per forward, its gradient the sum of
    both uses. "column" gives vocabulary-parallel logits for ztrain.nn.vocab_parallel_cross_entropy,
    "column_gathered" all of them for torch's cross entropy.

    pp_size > 1 (with init_distributed(pp_size=...)) cuts the units — the modules of one
    ModuleList — over the pipeline stages: the list becomes a ztrain.PipelineBlockList of
    num_microbatches micro-batches (default pp_size), each stage keeping its own layers as units.
    The model's forward stays as written: its loop `for layer in self.layers: x = layer(x, ...)`
    makes one call, which runs the whole pipeline on the parts of the batch that the ranks of the
    pipeline bring, and hands each rank the output of its own part. Each rank therefore feeds
    its own part of the data, as under DDP over ztrain.data_parallel() ranks, and the loss it
    computes is its part's (GPipe's order); or Booster.execute_pipeline takes one batch per
    pipeline (ColossalAI's way), cuts it into the micro-batches and runs them by pp_style: "1f1b"
    (default), "gpipe" or "interleaved" with num_model_chunks >= 2 model chunks per stage."""

    _STYLES = {"column": torch.nn.Linear, "column_gathered": torch.nn.Linear, "row": torch.nn.Linear,
               "vocab": torch.nn.Embedding}

    def __init__(self, tp_size, tensor_parallel=None, zero_stage=0, pp_size=1, num_microbatches=None, adapt=None,
                 wrap=None, use_checkpoint=False, prefetch_depth=1, pp_style="1f1b", num_model_chunks=1):
        tensor_parallel = tensor_parallel or {}
        if zero_stage not in (0, 1, 2, 3):
            raise _C.Error(f"HybridParallelPlugin: zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        if pp_style not in ("1f1b", "gpipe", "interleaved"):
            raise _C.Error(f"HybridParallelPlugin: pp_style must be '1f1b', 'gpipe' or 'interleaved', got {pp_style!r}")
        if (pp_style == "interleaved") != (num_model_chunks > 1):
            raise _C.Error(f"HybridParallelPlugin: pp_style='interleaved' takes num_model_chunks >= 2 (the model "
                           f"chunks of each stage), the others 1; got pp_style={pp_style!r}, "
                           f"num_model_chunks={num_model_chunks}")
        for path, style in tensor_parallel.items():
            if style not in self._STYLES:
                raise _C.Error(f"HybridParallelPlugin: '{path}': the style must be one of {', '.join(self._STYLES)}, "
                               f"got {style!r}")
        super().__init__(zero_stage, wrap, use_checkpoint, prefetch_depth)
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.num_microbatches = num_microbatches
        self.tensor_parallel = dict(tensor_parallel)
        self.adapt = adapt
        self.pp_style = pp_style
        self.num_model_chunks = num_model_chunks

    def configure(self, model):
        from . import nn as tp_nn
        if _C._group_size("tp") != self.tp_size:
            raise _C.Error(f"HybridParallelPlugin: tp_size={self.tp_size} but the runtime's tensor-parallel groups "
                           f"have {_C._group_size('tp')} ranks; call ztrain.init_distributed(tp_size={self.tp_size})")
        if _C._group_size("pp") != self.pp_size:
            raise _C.Error(f"HybridParallelPlugin: pp_size={self.pp_size} but the runtime has {_C._group_size('pp')} "
                           f"pipeline stages; call ztrain.init_distributed(pp_size={self.pp_size})")
        modules = dict(model.named_modules())
        units = self._units(model)  # before the cut: the layers the rules name are replaced below
        unit_names = [name for name, _, _, _ in units]
        style_of = {}  # module path -> (rule, style)
        for rule, style in self.tensor_parallel.items():
            pattern = re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in rule.split(".")))
            matched = [name for name in modules if name and pattern.fullmatch(name)]
            if not matched:
                raise _C.Error(f"HybridParallelPlugin: the rule '{rule}' matches no module of {type(model).__name__}")
            for name in matched:
                if name in style_of:
                    raise _C.Error(f"HybridParallelPlugin: '{name}' matches the rules '{style_of[name][0]}' and '{rule}'")
                cls = self._STYLES[style]
                if type(modules[name]) is not cls:
                    raise _C.Error(f"HybridParallelPlugin: '{name}' (rule '{rule}') is a {type(modules[name]).__name__}; "
                                   f"the style '{style}' splits a torch.nn.{cls.__name__}")
                style_of[name] = (rule, style)
        inside = {name for name in style_of if any(name == unit or name.startswith(unit + ".") for unit in unit_names)}
        self._check_ties(model, style_of, inside)
        for p in model.parameters():  # every rank cuts the same full layers
            _C._broadcast(p.data, 0, "world")
        slices = {}  # id(a parameter of a layer outside the units) -> the DistributedParameter of its slice
        for name, (_, style) in style_of.items():
            dense = modules[name]
            if style == "vocab":
                layer = tp_nn.VocabParallelEmbedding.from_embedding(dense)
            elif style == "row":
                layer = tp_nn.RowParallelLinear.from_linear(dense)
            else:
                layer = tp_nn.ColumnParallelLinear.from_linear(dense, gather_output=style == "column_gathered")
            parent, _, attribute = name.rpartition(".")
            setattr(modules[parent] if parent else model, attribute, layer)
            units = [(n, p, a, layer if n == name else m) for n, p, a, m in units]  # a unit the rule names itself
            for kind in ("weight", "bias"):
                old = getattr(dense, kind, None)
                if old is None:
                    continue
                new = getattr(layer, kind)
                if name not in inside and getattr(new, "tp_split_dim", None) is not None:
                    if id(old) not in slices:  # a tied weight: the first of its layers makes it
                        slices[id(old)] = DistributedParameter(new.detach(), new.requires_grad, self.zero_level,
                                                               new.tp_split_dim)
                    new = slices[id(old)]
                    setattr(layer, kind, new)
                self.replaced[id(new)] = old
        if self.adapt is not None:
            self.adapt(model, self.tp_size)
        if self.pp_size == 1:
            return self._wrap(model, units)
        return self._cut_into_stages(model, units)

    def _check_ties(self, model, style_of, inside):
        """A parameter of a layer a rule splits may be shared only with layers outside the units
        whose rules cut it the same way (a head tied to the embedding)."""
        def split(style, kind):  # the dimension a style cuts a parameter along: the rows but for "row"'s
            return {("row", "weight"): 1, ("row", "bias"): None}.get((style, kind), 0)

        users = {}  # id(parameter) -> the names it has in the model
        for owner, m in model.named_modules(remove_duplicate=False):
            for full, p in m.named_parameters(prefix=owner, recurse=False):
                users.setdefault(id(p), []).append(full)
        for name, (rule, style) in style_of.items():
            for kind, p in model.get_submodule(name).named_parameters(recurse=False):
                others = [u for u in users[id(p)] if u != f"{name}.{kind}"]
                for other in others:
                    owner, _, other_kind = other.rpartition(".")
                    if owner not in style_of:
                        raise _C.Error(f"HybridParallelPlugin: '{name}.{kind}' (rule '{rule}') is shared with "
                                       f"'{other}', which no rule splits; a head tied to the embedding takes "
                                       "'column' or 'column_gathered' with the embedding's 'vocab'")
                    if split(style_of[owner][1], other_kind) != split(style, kind):
                        raise _C.Error(f"HybridParallelPlugin: '{name}.{kind}' (rule '{rule}') is shared with "
                                       f"'{other}' (rule '{style_of[owner][0]}'), which splits it another way")
                if others and name in inside:
                    raise _C.Error(f"HybridParallelPlugin: '{name}.{kind}' (rule '{rule}') is shared with "
                                   f"'{others[0]}' inside a unit; tied layers must be outside the units")

    def _cut_into_stages(self, model, units):
        self._check_unshared(model, units)
        parents = {id(parent): parent for _, parent, _, _ in units}
        if len(parents) != 1 or not isinstance(next(iter(parents.values())), torch.nn.ModuleList):
            raise _C.Error(f"HybridParallelPlugin: pp_size={self.pp_size} cuts the modules of one ModuleList over the "
                           f"stages, but the units are {', '.join(name for name, _, _, _ in units)}")
        (layers,) = parents.values()
        if len(layers) != len(units):
            raise _C.Error("HybridParallelPlugin: every module of the pipelined ModuleList must be a unit")
        path = units[0][0].rpartition(".")[0]
        parent, _, attribute = path.rpartition(".")
        pipeline = _PipelinedList(list(layers), self.zero_level, self.use_checkpoint, self.num_microbatches,
                                  self.prefetch_depth, self.num_model_chunks)
        setattr(model.get_submodule(parent) if parent else model, attribute, pipeline)
        return [name for name, _, _, _ in units]


class _PipelinedList(PipelineBlockList):
    """A ModuleList cut over the pipeline stages whose loop over its layers, as the model's
    forward writes it, makes one call: the whole pipeline."""

    def __iter__(self):
        return iter([self])


class BoostedOptimizer:
    """The optimizer boost() returns: step() clips and steps through ztrain.optim.OptimManager;
    everything else (param_groups, state_dict, …) is the wrapped optimizer's."""

    def __init__(self, optimizer, manager, max_grad_norm):
        self.optim = optimizer
        self._manager = manager
        self._max_grad_norm = max_grad_norm
        self.last_grad_norm = float("nan")

    def zero_grad(self, set_to_none=True):
        self._manager.zero_grad()

    def step(self):
        """Clips (max_grad_norm > 0) and applies the step unless a rank found an inf or NaN
        (collective). Returns whether it was applied."""
        if self._max_grad_norm > 0:
            self.last_grad_norm = self._manager.clip_grad_norm(self._max_grad_norm)
        return self._manager.step()

    @property
    def loss_scale(self):
        return self._manager.loss_scale

    def __getattr__(self, name):
        return getattr(self.optim, name)


class Booster:
    """Runs the steps around a plugin: loss scaling (loss_scale: None = off, a number = dynamic
    from there, as OptimManager), clipping to max_grad_norm (0: none), saves and loads."""

    def __init__(self, plugin, max_grad_norm=0.0, loss_scale=None):
        if not isinstance(plugin, Plugin):
            raise _C.Error(f"Booster: the plugin must be a ztrain.booster plugin, got {type(plugin).__name__}")
        self.plugin = plugin
        self.max_grad_norm = float(max_grad_norm)
        self.loss_scale = loss_scale
        self._model = None
        self._replicated = []
        self._sync = True
        self._boundary = None  # execute_pipeline's, made at its first call

    def boost(self, model, optimizer, criterion=None, dataloader=None, lr_scheduler=None):
        """Wraps `model`'s units in place and re-targets `optimizer` at what the ranks now train
        (collective). Returns (model, boosted optimizer, criterion, dataloader, lr_scheduler), the
        others as given."""
        if self._model is not None:
            raise _C.Error("Booster: boost() was called already; a booster boosts one model")
        if not isinstance(optimizer, _NativeAdam) or isinstance(optimizer, AdamOffload):
            raise _C.Error(f"Booster: the optimizer must be a ztrain.optim.AdamW or Adam over the model's parameters, "
                           f"got {type(optimizer).__name__}")
        if optimizer.state:
            raise _C.Error("Booster: the optimizer has stepped already; boost before the first step")
        group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        if set(group_of) != {id(p) for p in model.parameters()}:
            raise _C.Error("Booster: the optimizer's parameters are not the model's (build it over "
                           "model.parameters(), or groups of them)")
        self.plugin.configure(model)
        self._replicated = [p for p in model.parameters() if not hasattr(p, "_native")]
        for p in self._replicated:
            _C._broadcast(p.data, 0, "dp")
        group_of.update({new: group_of[id(old)] for new, old in self.plugin.replaced.items()})
        group_of.update(_shard_groups(model, group_of))
        groups = [[] for _ in optimizer.param_groups]
        for p in model.parameters():
            groups[group_of[id(p)]].append(p)
        optimizer._retarget(groups)
        manager = OptimManager(model, loss_scale=self.loss_scale)
        manager.add_optimizer(optimizer)
        self._model = model
        self._optimizer = BoostedOptimizer(optimizer, manager, self.max_grad_norm)
        self._lr_schedulers = [lr_scheduler] if lr_scheduler is not None else []
        return model, self._optimizer, criterion, dataloader, lr_scheduler

    def backward(self, loss, optimizer):
        """Backward of the (scaled) loss; the gradients averaged over the data-parallel group
        when it returns (summed on this rank only inside no_sync). With pipeline stages, where
        each rank's loss is its part's, over every part: the dp ranks' of every stage."""
        size, _ = stages()
        optimizer._manager.backward(loss / size if size > 1 else loss)
        if self._sync:
            self._average_replicated()

    def _average_replicated(self):
        all_reduce_gradients([p for p in self._replicated if p.requires_grad], "avg", "dp")

    def execute_pipeline(self, data_iter, model, criterion, optimizer=None, return_loss=True, return_outputs=False):
        """One step's forward and backward on next(data_iter), a batch that every rank of a
        pipeline takes alike (ColossalAI's execute_pipeline): the batch is cut into the plugin's
        micro-batches (every tensor along dimension 0; a dict goes in as keywords, a tuple or list
        positionally), which run through the stages by the plugin's schedule (pp_style: "1f1b",
        "gpipe" or "interleaved", the C++ engine's schedules). Each stage runs the model's forward
        on a micro-batch up to the end of one of its model chunks, the last virtual stage to the
        end, where `criterion(outputs, inputs)` gives the micro-batch's loss; backward runs when
        an optimizer is given, each micro-batch's loss counting 1/m. Returns {"loss": the batch's
        mean loss on every rank, "outputs": the last stage's model outputs of the micro-batches
        joined along dimension 0 (a scalar each: stacked), None on the other stages}. Without pipeline stages the micro-batches run
        one after another (gradient accumulation)."""
        size, stage = stages()
        pipeline = next((m for m in model.modules() if isinstance(m, PipelineBlockList)), None)
        count = pipeline.micro_batches if pipeline is not None else getattr(self.plugin, "num_microbatches", None) or 1
        chunks = pipeline.chunks if pipeline is not None else 1
        virtual_stages = size * chunks
        batch = next(data_iter)
        micro = [_cut(batch, count, j) for j in range(count)]
        if optimizer is None:  # forwards alone, micro-batch by micro-batch, chunk by chunk
            schedule = [(op, j, c) for j in range(count) for c in range(chunks) for op, needed in (
                ("RF", c * size + stage > 0), ("F", True), ("SF", c * size + stage < virtual_stages - 1)) if needed]
        else:  # (op, micro-batch, chunk) in the C++ engine's order
            schedule = _C._pipeline_schedule(getattr(self.plugin, "pp_style", "1f1b"), size, stage, count, chunks)
        # Each chunk's last backward reduces the gradients (an engine takes part in the backward
        # of one chunk: its blocks, or the modules before and after the pipeline in the first and
        # last chunk); the others hold them, summed.
        final = {c: i for i, (op, _, c) in enumerate(schedule) if op == "B"}
        # Micro-batches in flight together each gather a DistributedParameter (and reduce its
        # gradient) for themselves.
        shared = [p._native for p in model.parameters() if isinstance(p, DistributedParameter)]
        # The C++ pipeline's boundary: activations go to the next rank (the last one's to the
        # first, for the next chunk), gradients to the previous one, each send on its own thread;
        # a message's id is its micro-batch and the virtual stage that sent it.
        if self._boundary is None:
            self._boundary = _C._Boundary()  # collective over the pipeline group
        boundary = self._boundary
        received, sent, grads, losses, outputs = {}, {}, {}, [], []
        for i, (op, j, c) in enumerate(schedule):
            virtual = c * size + stage
            last = virtual == virtual_stages - 1
            if op == "RF":
                (received[j, c],) = boundary.recv_forward(j * virtual_stages + virtual - 1)
            elif op == "F":
                for native in shared:
                    native.new_forward()
                with torch.set_grad_enabled(optimizer is not None):
                    # Backward (SB) sends the received activation's gradient; forwards alone drop it.
                    x = received.get((j, c)) if optimizer is not None else received.pop((j, c), None)
                    out = _run_micro_batch(model, pipeline, micro[j], x, c)
                    if last:
                        loss = criterion(out, micro[j])
                        losses.append(loss.detach().float())
                        if return_outputs:
                            outputs.append(out)
                if optimizer is not None or not last:  # what backward or the next stage takes
                    sent[j, c] = loss if last else out
            elif op == "SF":
                boundary.send_forward([sent[j, c] if optimizer is not None else sent.pop((j, c))],
                                      j * virtual_stages + virtual)
            elif op == "RB":
                (grads[j, c],) = boundary.recv_backward(j * virtual_stages + virtual + 1)
            elif op == "B":
                y = sent.pop((j, c))
                # The last virtual stage's loss scaled, the others' outputs taking the scaled
                # gradient the next one sent.
                with _block_no_sync(model) if i != final[c] else contextlib.nullcontext():
                    scaled = y / count if last else (y * grads.pop((j, c))).sum() / optimizer.loss_scale
                    optimizer._manager.backward(scaled)
            elif op == "SB":
                x = received.pop((j, c))
                boundary.send_backward([x.grad if x.grad is not None else torch.zeros_like(x)],
                                       j * virtual_stages + virtual)
        boundary.synchronize()
        last = stage == size - 1  # holds the last virtual stage
        if optimizer is not None:
            count_backward_pass()
            if self._sync:
                self._average_replicated()
        out = {}
        if return_loss:
            mean = torch.stack(losses).mean() if last else torch.empty((), dtype=torch.float32)
            if size > 1:
                _C._broadcast(mean, size - 1, "pp")
            out["loss"] = mean
        if return_outputs:
            out["outputs"] = _join(outputs) if last else None
        return out

    @contextlib.contextmanager
    def no_sync(self, model=None, optimizer=None):
        """Backward passes inside keep their gradients on this rank, summed; the first backward
        after it averages the sums (gradient accumulation that communicates once per step)."""
        self._sync = False
        try:
            with _block_no_sync(self._boosted("no_sync")):
                yield
        finally:
            self._sync = True

    def save_model(self, model, path):
        """The model file: full tensors under the plain model's names (ztrain.save). Collective."""
        save(model, path)

    def load_model(self, model, path, strict=True):
        """A model file of any world size, plugin or level (ztrain.load). Collective."""
        load(model, path, strict)

    def save_optimizer(self, optimizer, path):
        """The optimizer state, resharding (ztrain.save_optimizer). Collective."""
        save_optimizer(self._boosted("save_optimizer"), _unwrap(optimizer), path)

    def load_optimizer(self, optimizer, path):
        load_optimizer(self._boosted("load_optimizer"), _unwrap(optimizer), path)

    def save_checkpoint(self, root, step, extra=None, keep_last=0):
        """A training checkpoint under `root` (ztrain.save_checkpoint): the model, the optimizer's
        state and hyperparameters, the lr_scheduler given to boost(), the loss scale and step
        counters, each rank's generators and `extra`; returns its directory. Collective."""
        self._boosted("save_checkpoint")
        return save_checkpoint(root, step, self._optimizer._manager, extra, keep_last, self._lr_schedulers)

    def load_checkpoint(self, path):
        """Loads a checkpoint written under any plugin and world size (ztrain.load_checkpoint);
        returns {"dir", "step", "world_size", "extra"}. Collective."""
        self._boosted("load_checkpoint")
        return load_checkpoint(path, self._optimizer._manager, self._lr_schedulers)

    def _boosted(self, what):
        if self._model is None:
            raise _C.Error(f"Booster.{what}: boost() a model first")
        return self._model


def _shard_groups(model, group_of):
    """{id(shard): param group} for the shards of `model`'s Blocks: the group of the parameters
    each holds, which must be one. A Block keeps the parameters weight decay skips (fewer than
    two dimensions) in shards apart from the others, so the usual split of biases and norms from
    weights holds."""
    out = {}
    for path, block in model.named_modules():
        if not isinstance(block, Block):
            continue
        module_params = dict(block.module.named_parameters())
        for shard, members in zip(block._native.shards(), block._native.group_members()):
            groups = sorted({group_of[id(module_params[name])] for name in members})
            if len(groups) > 1:
                first = {g: next(n for n in members if group_of[id(module_params[n])] == g) for g in groups}
                raise _C.Error(f"Booster: the unit '{path}' keeps " + ", ".join(
                    f"'{first[g]}' (param group {g})" for g in groups) + " in one flat shard; a unit shards its "
                    "parameters of one dtype together, its weights apart from its biases and norms, so param "
                    "groups may split a unit only that way")
            out[id(shard)] = groups[0]
    return out


def _run_micro_batch(model, pipeline, part, received, chunk):
    """The model's forward on one micro-batch: up to the end of one of this stage's model chunks
    (its output), or to the end of the model on the last virtual stage (the model's output)."""
    if pipeline is None:
        return _call(model, part)
    pipeline.micro_batch = MicroBatch(received, chunk)
    try:
        return _call(model, part)
    except StageDone:
        return pipeline.micro_batch.output
    finally:
        pipeline.micro_batch = None


def _call(model, part):
    if isinstance(part, dict):
        return model(**part)
    if isinstance(part, (tuple, list)):
        return model(*part)
    return model(part)


def _join(outputs):
    """The micro-batches' outputs along dimension 0 (scalars stacked), tensor by tensor."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs) if first.dim() > 0 else torch.stack(outputs)
    if isinstance(first, dict):
        return {k: _join([o[k] for o in outputs]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_join(list(parts)) for parts in zip(*outputs))
    return outputs


def _cut(batch, parts, index):
    """Part `index` of `parts` of every tensor in `batch` (along dimension 0)."""
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % parts:
            raise _C.Error(f"Booster.execute_pipeline: a batch of {batch.shape[0]} does not cut into {parts} "
                           "micro-batches")
        return batch.chunk(parts)[index] if parts > 1 else batch
    if isinstance(batch, dict):
        return {k: _cut(v, parts, index) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cut(v, parts, index) for v in batch)
    return batch


def _unwrap(optimizer):
    return optimizer.optim if isinstance(optimizer, BoostedOptimizer) else optimizer
