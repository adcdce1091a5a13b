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


class _NativeAdam(torch.optim.Optimizer):
    _decoupled = True

    def __init__(self, params, lr, betas, eps, weight_decay, num_threads):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._native = _C._Adam([(list(g["params"]), self._hyper(g)) for g in self.param_groups], self._decoupled,
                                num_threads)

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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):  # an LR schedule may have changed them
            self._native.set_options(i, self._hyper(group))
        self._native.step()
        return loss

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self):
        """torch.optim.AdamW's layout: {"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master"]}},
        "param_groups": [...]}, parameters numbered across the groups in order."""
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
