"""BMTrain's optimizers and OptimManager on ztrain's native kernels.

AdamOptimizer follows BMTrain's update: weight decay added to the gradient (Adam) for fp32
parameters and decoupled (AdamW) for fp16/bf16 ones, which BMTrain's half kernels use.
AdamOffloadOptimizer is ZeRO-Offload's AdamW (BMTrain's CPU kernel decouples too). The
OptimManager takes no model, as BMTrain's: it learns the model from its optimizers' parameters
when first used, so every optimizer is added before the first zero_grad or backward.
"""
import torch

from .. import _C
from .. import optim as _optim
from .. import pipeline as _pipeline
from .global_var import config


def _native_view(params):
    """The engine's modules owning `params` and the plain parameters among them, as a model view;
    every shard of an owning module must be among `params`."""
    owners, plain = {}, []
    for p in params:
        owner = getattr(p, "_native", None)
        if owner is None:
            plain.append(p)
        else:
            owners[id(owner)] = owner
    ids = {id(p) for p in params}
    if any(id(s) not in ids for owner in owners.values() for s in owner.shards()):
        raise _C.Error("ztrain.bmtrain.optim: the parameters must include every shard of each Block and "
                       "DistributedParameter they come from (pass model.parameters())")
    return [(f"m{i}", o) for i, o in enumerate(owners.values())], [(f"p{i}", p) for i, p in enumerate(plain)], plain


class _BMTrainAdam(_optim._NativeAdam):
    _bmtrain_optimizer = True

    def _setup_hold(self, hold_steps):
        self._hold_steps = hold_steps
        self._steps = 0

    def _sync_options(self):
        for i, group in enumerate(self.param_groups):
            lr = 0.0 if self._steps < self._hold_steps else group["lr"]
            self._native.set_options(i, self._hyper(dict(group, lr=lr)))

    @torch.no_grad()
    def step(self, closure=None, scale=1):
        if scale != 1:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad /= scale
        loss = super().step(closure)
        self._steps += 1
        return loss


class AdamOptimizer(_BMTrainAdam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0):
        params = list(params)
        tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
        half = {t.dtype != torch.float32 for t in tensors}
        if len(half) > 1 and weight_decay != 0:
            raise _C.Error("AdamOptimizer: BMTrain decays fp32 parameters through the gradient and fp16/bf16 ones "
                           "decoupled; give each kind its own optimizer")
        self._decoupled = half == {True}
        super().__init__(params, lr, betas, eps, weight_decay, None)
        self._setup_hold(hold_steps)


class AdamOffloadOptimizer(_BMTrainAdam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, hold_steps=0,
                 record_delta=False):
        if record_delta:
            raise _C.Error("AdamOffloadOptimizer(record_delta=True) is not supported by ztrain.bmtrain")
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise _C.Error("AdamOffloadOptimizer: one group of parameters (pass model.parameters())")
        blocks, plain, _ = _native_view(params)
        native = _C._Adam.offload(blocks, plain, (float(lr), float(betas[0]), float(betas[1]), float(eps),
                                                  float(weight_decay)), None)
        super().__init__(native.params(0), lr, betas, eps, weight_decay, None, native)
        self._setup_hold(hold_steps)

    def wait(self):
        self._native.wait()


_UNBOUNDED = 2.0 ** 64  # BMTrain's max_loss_scale=inf: ztrain's scaler needs a finite bound


class OptimManager:
    """BMTrain's OptimManager: loss scaling (dynamic from loss_scale; None: off), clipping,
    steps skipped on every rank when a gradient overflows, schedules stepped after each applied
    step. Gradients come out as BMTrain's: the sum over the ranks of the stage (the data-parallel
    ones, and the tensor-parallel ones for parameters replicated over tp) divided by grad_scale
    (default config["zero_size"], every rank of the stage); without tensor parallelism that is
    the mean over the data-parallel ranks; with pipelines, the sum over every rank (each stage
    brings its part of the batch) divided by grad_scale (config["zero_size"], the ranks of one
    stage). Plain torch parameters outside Blocks and DistributedParameters are kept replicated:
    their gradients are averaged over the data-parallel group in backward; those outside the
    pipeline are summed over the stages by clip_grad_norm or step, whichever comes first."""

    def __init__(self, loss_scale=None, loss_scale_factor=2, loss_scale_steps=1024, min_loss_scale=1,
                 max_loss_scale=float("inf"), grad_scale=None):
        self._options = (None if loss_scale is None else float(loss_scale), True,
                         float(loss_scale_factor if loss_scale_factor > 1 else 1 / loss_scale_factor),
                         int(loss_scale_steps), float(min_loss_scale), min(float(max_loss_scale), _UNBOUNDED))
        self.grad_scale = config["zero_size"] if grad_scale is None else grad_scale
        self.optimizers = []
        self.lr_schedulers = []
        self._native = None
        self._plain = []

    def add_optimizer(self, optimizer, lr_scheduler=None):
        if self._native is not None:
            raise _C.Error("OptimManager.add_optimizer: add every optimizer before the first zero_grad or backward")
        if not isinstance(optimizer, _optim._NativeAdam):
            raise _C.Error(f"OptimManager: steps ztrain's optimizers (bmt.optim.AdamOptimizer, "
                           f"AdamOffloadOptimizer), got {type(optimizer).__name__}")
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)

    def _manager(self):
        if self._native is None:
            if not self.optimizers:
                raise _C.Error("OptimManager: add an optimizer first")
            params = [p for opt in self.optimizers for p in opt._params()]
            blocks, plain, self._plain = _native_view(params)
            self._native = _C._OptimManager(blocks, plain, *self._options)
            for optimizer in self.optimizers:
                self._native.add_optimizer(optimizer._native)
        return self._native

    @property
    def loss_scale(self):
        return self._native.loss_scale if self._native is not None else (self._options[0] or 1)

    def zero_grad(self):
        self._manager().zero_grad()

    def backward(self, loss):
        manager = self._manager()
        # The engine averages over the data-parallel group (tp_zero_size ranks); BMTrain sums
        # over the stage and divides by grad_scale.
        if self.grad_scale != config["tp_zero_size"]:
            loss = loss * (config["tp_zero_size"] / self.grad_scale)
        manager.backward(loss)
        if config["tp_zero_size"] > 1:
            for p in self._plain:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _C._all_reduce(p.grad, "avg", "dp")

    def clip_grad_norm(self, param_groups, max_norm, norm_type=2, eps=1e-6):
        """Clips the gradients of every managed parameter to a global L2 norm of max_norm and
        returns the norm before clipping (unscaled). `param_groups` must cover every managed
        parameter: clipping a part alone is not supported."""
        if norm_type != 2:
            raise _C.Error(f"OptimManager.clip_grad_norm: only the L2 norm is supported, got norm_type={norm_type}")
        given = {id(p) for group in param_groups for p in group["params"]}
        managed = {id(p) for opt in self.optimizers for p in opt._params()}
        if given != managed:
            raise _C.Error("OptimManager.clip_grad_norm: pass the param_groups of every added optimizer; clipping "
                           "part of the parameters is not supported")
        manager = self._manager()
        self._sum_over_stages()
        return manager.clip_grad_norm(float(max_norm))

    def _sum_over_stages(self):
        _pipeline.sum_over_stages([p for opt in self.optimizers for p in opt._params()])

    def state_dict(self, gather_opt=False):
        """BMTrain's layout: {"optimizers": [each optimizer's state_dict()], "lr_schedulers":
        [...], "loss_scale", "loss_scale_enabled"}, plus the dynamic scaler's counters and the
        step counts under "ztrain". The optimizers' states are this rank's shards (save one file
        per rank, load it on the same layout)."""
        if gather_opt:
            raise _C.Error("OptimManager.state_dict(gather_opt=True): optimizer states are saved per rank here; "
                           "gathering them is not supported")
        scale, growth_tracker, hysteresis_left, steps, skipped = self._manager().state()
        return {"optimizers": [opt.state_dict() for opt in self.optimizers],
                "lr_schedulers": [s.state_dict() if s is not None else None for s in self.lr_schedulers],
                "loss_scale": scale, "loss_scale_enabled": self._options[0] is not None,
                "ztrain": {"growth_tracker": growth_tracker, "hysteresis_left": hysteresis_left, "steps": steps,
                           "skipped": skipped}}

    def load_state_dict(self, state_dict):
        """Restores what state_dict() gave (or BMTrain's own layout, without the "ztrain" part):
        the same optimizers and schedules, added in the same order."""
        for key, mine in (("optimizers", self.optimizers), ("lr_schedulers", self.lr_schedulers)):
            if len(state_dict[key]) != len(mine):
                raise _C.Error(f"OptimManager.load_state_dict: the state has {len(state_dict[key])} {key}, this "
                               f"manager {len(mine)}")
        manager = self._manager()
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"]):
            optimizer.load_state_dict(state)
        for scheduler, state in zip(self.lr_schedulers, state_dict["lr_schedulers"]):
            if scheduler is not None and state is not None:
                scheduler.load_state_dict(state)
        _, growth_tracker, hysteresis_left, steps, skipped = manager.state()
        counters = state_dict.get("ztrain", {"growth_tracker": growth_tracker, "hysteresis_left": hysteresis_left,
                                             "steps": steps, "skipped": skipped})
        manager.load_state(float(state_dict["loss_scale"]), counters["growth_tracker"], counters["hysteresis_left"],
                           counters["steps"], counters["skipped"])
        for optimizer in self.optimizers:
            if hasattr(optimizer, "_steps"):
                optimizer._steps = counters["steps"]

    def step(self):
        manager = self._manager()
        self._sum_over_stages()
        for optimizer in self.optimizers:
            optimizer._sync_options()
        before = manager.loss_scale
        if not manager.step():
            from .. import print_rank
            print_rank("Gradient overflow, change scale from %lf to %lf" % (before, manager.loss_scale))
            return
        for optimizer, scheduler in zip(self.optimizers, self.lr_schedulers):
            if hasattr(optimizer, "_steps"):
                optimizer._steps += 1
            if scheduler is not None:
                scheduler.step()
