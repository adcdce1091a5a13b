"""BMTrain's learning-rate schedules, with its argument meanings: `start_lr` is the peak rate
the warmup climbs to (Noam's is scaled as in the paper), `warmup_iter` and `end_iter` count
steps, `num_iter` is where to start. step() sets every group's lr of the optimizer; the
OptimManager calls it after each applied step."""
import math


class WarmupLRScheduler:
    def __init__(self, optimizer, start_lr, warmup_iter, end_iter, num_iter=0):
        self.start_lr = start_lr
        self.warmup_iter = warmup_iter
        self.end_iter = end_iter
        self.optimizer = optimizer
        self.num_iter = num_iter
        self._current_lr = None
        self.step(self.num_iter)

    def get_lr_warmup(self, num_iter):
        raise NotImplementedError

    def get_lr_decay(self, num_iter):
        raise NotImplementedError

    def get_lr(self):
        if self.num_iter < self.warmup_iter:
            return self.get_lr_warmup(self.num_iter)
        return self.get_lr_decay(self.num_iter)

    @property
    def current_lr(self):
        return self._current_lr

    def step(self, num_iter=None):
        self.num_iter = self.num_iter + 1 if num_iter is None else num_iter
        self._current_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = self._current_lr

    def state_dict(self):
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "end_iter": self.end_iter,
                "num_iter": self.num_iter}

    def load_state_dict(self, state_dict):
        self.start_lr = state_dict["start_lr"]
        self.warmup_iter = state_dict["warmup_iter"]
        self.end_iter = state_dict["end_iter"]
        self.num_iter = state_dict["num_iter"]
        self.step(self.num_iter)


class Noam(WarmupLRScheduler):
    """start_lr / √warmup_iter × num_iter / warmup_iter during warmup, start_lr / √num_iter after."""

    def get_lr_warmup(self, num_iter):
        return self.start_lr / math.sqrt(self.warmup_iter) * num_iter / self.warmup_iter

    def get_lr_decay(self, num_iter):
        return self.start_lr / math.sqrt(num_iter)


class _LinearWarmup(WarmupLRScheduler):
    def get_lr_warmup(self, num_iter):
        return self.start_lr * num_iter / self.warmup_iter


class Linear(_LinearWarmup):
    """Linear warmup to start_lr, then linear decay to 0 at end_iter."""

    def get_lr_decay(self, num_iter):
        return max(0.0, self.start_lr * (self.end_iter - num_iter) / (self.end_iter - self.warmup_iter))


class Cosine(_LinearWarmup):
    """Linear warmup to start_lr, then half a cosine down to 0 at end_iter."""

    def get_lr_decay(self, num_iter):
        progress = (num_iter - self.warmup_iter) / max(1, self.end_iter - self.warmup_iter)
        return max(0.0, self.start_lr * 0.5 * (1.0 + math.cos(progress * math.pi)))


class Exponential(_LinearWarmup):
    """Linear warmup to start_lr, then start_lr × gamma^(num_iter - warmup_iter)."""

    def __init__(self, optimizer, start_lr, warmup_iter, end_iter, num_iter, gamma=0.95):
        self.gamma = gamma  # before the first step, which reads it
        super().__init__(optimizer, start_lr, warmup_iter, end_iter, num_iter)

    def get_lr_decay(self, num_iter):
        return max(0.0, self.start_lr * self.gamma ** (num_iter - self.warmup_iter))


class NoDecay(_LinearWarmup):
    """Linear warmup to start_lr, then start_lr."""

    def get_lr_decay(self, num_iter):
        return self.start_lr
