"""ztrain's fused SIMD Adam and AdamW as torch.optim optimizers.

They are torch.optim.Optimizer subclasses: param_groups, zero_grad(), torch's LR schedulers and
state_dict()/load_state_dict() in torch.optim.AdamW's format work as with torch's own, and a
state dict moves between them and torch.optim.AdamW/Adam both ways. step() runs the native
kernel over every group (see include/ztrain/optim/adam.h): one pass per parameter, on the
optimizer's own threads, without the GIL. Parameters may be float32, or bfloat16/float16 with an
fp32 master copy in the state (state["master"]).
"""
import torch

from . import _C
from .block import native_view
from .pipeline import sum_over_stages


class _NativeAdam(torch.optim.Optimizer):
    _decoupled = True

    def __init__(self, params, lr, betas, eps, weight_decay, num_threads, native=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._num_threads = num_threads
        self._native = native or self._native_over_groups()

    def _native_over_groups(self):
        return _C._Adam([(list(g["params"]), self._hyper(g)) for g in self.param_groups], self._decoupled,
                        self._num_threads)

    def _retarget(self, groups):
        """Makes this optimizer (no state yet) update the parameters `groups[i]` in its group i
        instead, with the same hyperparameters: what the Booster does after a plugin moved the
        model's parameters into the engine's buffers."""
        for group, params in zip(self.param_groups, groups, strict=True):
            group["params"] = list(params)
        self._native = self._native_over_groups()

    @staticmethod
    def _hyper(group):
        beta1, beta2 = group["betas"]
        return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))

    @property
    def kernel(self):
        """The native kernel CPU parameters run: "avx512", "avx2", "scalar" or "torch_fused"."""
        return self._native.kernel

    def add_param_group(self, param_group):
        if hasattr(self, "_native"):
            raise _C.Error(f"{type(self).__name__}: add_param_group after construction is not supported; "
                           "pass every group to the constructor")
        super().add_param_group(param_group)

    def _sync_options(self):
        for i, group in enumerate(self.param_groups):  # an LR schedule may have changed them
            self._native.set_options(i, self._hyper(group))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_options()
        sum_over_stages(self._params())
        self._native.step()
        return loss

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self):
        """torch.optim.AdamW's layout: {"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master"]}},
        "param_groups": [...]}, parameters numbered across the groups in order. Waits for updates
        in flight first."""
        self._native.wait()
        out = super().state_dict()
        state = {}
        for index, p in enumerate(self._params()):
            s = self._native.state(p)
            if s is not None:
                step, exp_avg, exp_avg_sq, master = s
                entry = {"step": torch.tensor(float(step)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
                if master is not None:
                    entry["master"] = master
                state[index] = entry
        out["state"] = state
        return out

    def load_state_dict(self, state_dict):
        """Loads a state dict of this optimizer or of torch.optim.AdamW/Adam (same groups and
        parameter shapes). The moments are copied onto each parameter's device in fp32; a
        bf16/fp16 parameter without a master in the dict takes its current value as the master."""
        self._native.wait()
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = self._params()
        for index, entry in state_dict["state"].items():
            p = params[int(index)]
            fp32 = dict(device=p.device, dtype=torch.float32)
            master = entry.get("master")
            if p.dtype != torch.float32:
                master = (p.detach() if master is None else master).to(**fp32).contiguous().clone()
            else:
                master = None
            self._native.set_state(p, int(entry["step"]), entry["exp_avg"].to(**fp32).contiguous().clone(),
                                   entry["exp_avg_sq"].to(**fp32).contiguous().clone(), master)


class AdamW(_NativeAdam):
    """AdamW (decoupled weight decay), torch.optim.AdamW's arguments and defaults."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, num_threads=None):
        super().__init__(params, lr, betas, eps, weight_decay, num_threads)


class Adam(_NativeAdam):
    """Adam (weight decay added to the gradient), torch.optim.Adam's arguments and defaults."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, *, num_threads=None):
        super().__init__(params, lr, betas, eps, weight_decay, num_threads)


class AdamOffload(_NativeAdam):
    """AdamW whose state lives in host memory and whose update runs on a background thread
    behind the next forward, as ZeRO-Offload (the C++ AdamOffload): built on a model, it updates
    all of its parameters in one group. step() checks everything, updates the parameters outside
    Blocks at once, hands each Block shard's update to its thread and returns; a Block waits for
    its own shard only when its forward needs it. The numbers are AdamW's bit for bit. step()
    takes the gradients (every .grad is None afterwards); wait() blocks until the updates are done
    and raises an update's error. state_dir: the state in files there instead of memory, read in
    before each update and written back after it (ZeRO-Infinity's offload to disk; the same
    numbers).
    """

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, num_threads=None,
                 state_dir=None):
        native = _C._Adam.offload(*native_view(model), (float(lr), float(betas[0]), float(betas[1]), float(eps),
                                                        float(weight_decay)), num_threads,
                                  None if state_dir is None else str(state_dir))
        super().__init__(native.params(0), lr, betas, eps, weight_decay, num_threads, native)

    def wait(self):
        self._native.wait()


class OptimManager:
    """The steps around ztrain's optimizers, as BMTrain's OptimManager and the C++ one: loss
    scaling, gradient clipping over every shard and rank, and a step every rank skips when any
    rank's gradients hold an inf or NaN.

        manager = ztrain.optim.OptimManager(model, loss_scale=2**16)    # dynamic; None: off
        manager.add_optimizer(opt, lr_scheduler)                        # a ztrain.optim optimizer
        manager.zero_grad()
        manager.backward(loss)                 # (loss × scale).backward()
        manager.clip_grad_norm(1.0)            # the unscaled global norm, before clipping
        applied = manager.step()               # False: skipped on every rank, the scale backed off

    `model` tells which parameters are shards (those of Blocks at levels 1-3, each element
    counted once in the norm) and which are replicated (counted once per data-parallel group).
    A scale that changes (loss_scale_steps clean steps: × loss_scale_factor; an overflow: ÷) is
    kept within [min_loss_scale, max_loss_scale]; static_loss_scale=True keeps it fixed.
    clip_grad_norm and step are collective. The lr_scheduler (any torch one) steps after each
    applied step.
    """

    def __init__(self, model, loss_scale=None, loss_scale_factor=2.0, loss_scale_steps=1024, min_loss_scale=1.0,
                 max_loss_scale=float(2 ** 24), static_loss_scale=False):
        self._native = _C._OptimManager(*native_view(model), loss_scale, not static_loss_scale, loss_scale_factor,
                                        loss_scale_steps, min_loss_scale, max_loss_scale)
        self._params = list(model.parameters())
        self.optimizers = []
        self.lr_schedulers = []

    def add_optimizer(self, optimizer, lr_scheduler=None):
        if not isinstance(optimizer, _NativeAdam):
            raise _C.Error(f"OptimManager: steps ztrain.optim optimizers (natively), got {type(optimizer).__name__}")
        self._native.add_optimizer(optimizer._native)
        self.optimizers.append(optimizer)
        self.lr_schedulers.append(lr_scheduler)

    def zero_grad(self):
        self._native.zero_grad()

    def backward(self, loss):
        self._native.backward(loss)

    def clip_grad_norm(self, max_norm):
        sum_over_stages(self._params)
        return self._native.clip_grad_norm(float(max_norm))

    def grad_norm(self):
        sum_over_stages(self._params)
        return self._native.grad_norm()

    def step(self):
        sum_over_stages(self._params)
        for optimizer in self.optimizers:
            optimizer._sync_options()
        applied = self._native.step()
        if applied:
            for optimizer, scheduler in zip(self.optimizers, self.lr_schedulers):
                # The native step bypasses optimizer.step(), whose call torch's schedulers
                # look for; this is what its wrapper records.
                optimizer._opt_called = True
                if scheduler is not None:
                    scheduler.step()
        return applied

    @property
    def loss_scale(self):
        return self._native.loss_scale

    @property
    def steps(self):
        """Steps applied so far."""
        return self._native.steps

    @property
    def skipped_steps(self):
        return self._native.skipped_steps
