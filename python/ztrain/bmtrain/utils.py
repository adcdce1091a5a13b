"""BMTrain's utilities: print_rank, print_dict, print_block, AverageRecorder."""
import sys

from .. import print_rank


def print_dict(title, content, file=sys.stdout):
    """Prints `content` (a dict) under `title`, one key per line (on the calling rank)."""
    width = max([len(str(k)) for k in content] + [0]) + 3
    lines = [f"{'=' * 10} {title} {'=' * 10}"] + [f"{str(k)} :{' ' * (width - len(str(k)) - 2)}{v}" for k, v in content.items()]
    print("\n".join(lines), file=file, flush=True)


def print_block(title, content=None, level=1):
    """Prints `title` and, if given, the lines of `content` on rank 0."""
    lines = [f"{'=' * 10} {title} {'=' * 10}"]
    if content is not None:
        lines += [f"{'  ' * level}{line}" for line in str(content).split("\n")]
    print_rank("\n".join(lines))


class AverageRecorder:
    """An exponential moving average, as BMTrain's: value = Σ α^(n-i) (1-α) x_i / (1 - α^n)
    (bias-corrected, so the first value is the first record)."""

    def __init__(self, alpha=0.9, start_value=0):
        self._value = start_value
        self.alpha = alpha
        self._steps = 0

    def record(self, v):
        self._value = self._value * self.alpha + (1 - self.alpha) * v
        self._steps += 1

    @property
    def value(self):
        if self._steps <= 0:
            return self._value
        return self._value / (1 - pow(self.alpha, self._steps))
