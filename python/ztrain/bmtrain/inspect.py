"""BMTrain's inspection tools: statistics of parameters (inspect_model), of intermediate tensors
and their gradients (record_tensor inside inspect_tensor()), and a table (format_summary).

Statistics are of the whole tensor across ranks: parameters gathered, their gradients combined
from every rank's shard; a recorded tensor's mean and variance averaged over the ranks (each
rank holds part of the batch) and its max and min taken over them, as BMTrain does. Inside a
Block with recomputation, the gradient of a recorded tensor is that of its recomputed copy.
"""
import fnmatch
import math

import torch

from .. import _C
from .. import pipeline as _pipeline
from ..block import Block, native_view
from ..model_file import state_dict

_active = []  # the InspectTensor being recorded into, innermost last


class InspectTensor:
    def __init__(self):
        self._items = []

    def _record(self, x, name, group):
        key = f"{group}.{name}" if group is not None else name
        if torch._C._current_graph_task_id() != -1:
            # Recomputation in backward: the gradient flows through this copy of the tensor.
            for item in self._items:
                if item["key"] == key and item["recomputed"] is None:
                    if x.requires_grad:
                        x.retain_grad()
                    item["recomputed"] = x
                    return
            return
        if x.requires_grad:
            x.retain_grad()
        self._items.append({"key": key, "name": name, "group": group, "tensor": x, "recomputed": None})

    def get_summary(self):
        """[{name, shape, max, min, mean, std, grad_mean, grad_std}] of the recorded tensors
        (collective over every rank)."""
        counts = {}
        for item in self._items:
            counts[item["key"]] = counts.get(item["key"], 0) + 1
        seen = {}
        out = []
        world = _C.world_size()
        for item in self._items:
            x = item["tensor"].detach().float()
            holder = item["recomputed"] if item["recomputed"] is not None else item["tensor"]
            grad = holder.grad if holder.requires_grad else None
            stats = torch.tensor([x.mean(), x.var(unbiased=False)] +
                                 ([grad.float().mean(), grad.float().var(unbiased=False)] if grad is not None else []),
                                 dtype=torch.float64)
            extremes = torch.tensor([x.max(), -x.min()], dtype=torch.float64)
            _C._all_reduce(stats, "sum", "world")
            _C._all_reduce(extremes, "max", "world")
            stats /= world
            index = seen.get(item["key"], 0)
            seen[item["key"]] = index + 1
            prefix = "" if item["group"] is None else f"{item['group']}."
            name = f"{prefix}{index}.{item['name']}" if counts[item["key"]] > 1 else f"{prefix}{item['name']}"
            shape = tuple(item["tensor"].shape)
            out.append({
                "name": name,
                "shape": (shape[0] * world,) + shape[1:] if shape else shape,
                "max": extremes[0].item(),
                "min": -extremes[1].item(),
                "mean": stats[0].item(),
                "std": math.sqrt(stats[1].item()),
                "grad_mean": stats[2].item() if grad is not None else None,
                "grad_std": math.sqrt(stats[3].item()) if grad is not None else None,
            })
        return out

    def get_tensor(self, name, group=None, index=None):
        """The tensor recorded as `name` (in `group`; the index-th of that name), or None."""
        key = f"{group}.{name}" if group is not None else name
        found = [item["tensor"] for item in self._items if item["key"] == key]
        position = 0 if index is None else index
        return found[position] if position < len(found) else None


class _InspectTensorManager:
    def __enter__(self):
        inspector = InspectTensor()
        _active.append(inspector)
        return inspector

    def __exit__(self, *args):
        _active.pop()


def inspect_tensor():
    """A context in which record_tensor() records; run backward inside it to record gradients."""
    return _InspectTensorManager()


def record_tensor(x, name, group=None):
    """Records `x` under `name` for the innermost inspect_tensor() context (nothing outside one)."""
    if isinstance(x, torch.nn.Parameter):
        raise _C.Error("record_tensor: parameters are inspected with inspect_model, not recorded")
    if _active:
        _active[-1]._record(x, name, group)


def _gradient_moments(model):
    """{name: (Σg, Σg², n)} of every parameter's gradient summed over the ranks (collective).
    With pipeline stages, each stage counts its own layers and the first one the parameters
    every stage holds."""
    _pipeline.sum_over_stages(list(model.parameters()))  # those every stage holds, complete
    size, stage = _pipeline.stages()
    own = _pipeline.stage_local_names(model) if size > 1 else None
    blocks, params = native_view(model)
    whole = {id(m._native) for _, m in model.named_modules() if isinstance(m, Block) and m.zero_level == 0}
    parts = {}
    for path, native in blocks:
        if id(native) in whole and _C._group_rank("stage") != 0:
            continue  # level 0: every rank of the stage holds the whole gradient; count it once
        shards = native.shards()
        for g, name, offset, n in native.pieces():
            grad = shards[g].grad
            full = path if isinstance(native, _C._Parameter) else (f"{path}.{name}" if path else name)
            if stage > 0 and full not in own:
                continue  # every stage holds it, with the same gradient: the first counts it
            parts.setdefault(full, []).append(None if grad is None else grad.narrow(0, offset, n))
    if _C.rank() == 0:  # replicated: counted once
        for name, p in params:
            parts.setdefault(name, []).append(p.grad)
    names = [name for name, _ in _C._parameter_shapes(*native_view(model))]
    if size > 1:  # the same list on every rank: every stage's names
        names = sorted(set().union(*_pipeline.stage_objects(names)))
    sums = torch.zeros(len(names), 3, dtype=torch.float64)
    for i, name in enumerate(names):
        for g in parts.get(name, []):
            if g is not None:
                g = g.detach().double()
                sums[i] += torch.stack([g.sum(), (g * g).sum(), torch.tensor(float(g.numel()), dtype=torch.float64)])
    _C._all_reduce(sums, "sum", "world")
    return {name: tuple(sums[i].tolist()) for i, name in enumerate(names)}


def inspect_model(model, param_name, prefix=""):
    """[{name, shape, max, min, mean, std, grad_mean, grad_std}] of the parameters whose name
    matches the pattern `param_name` (fnmatch: "*", "transformers.*.weight"), full values
    (collective over every rank)."""
    values = state_dict(model)
    moments = _gradient_moments(model)
    out = []
    for name, value in values.items():
        if not fnmatch.fnmatch(prefix + name, param_name):
            continue
        v = value.double()
        total, squares, n = moments.get(name, (0.0, 0.0, 0.0))
        grad_mean = total / n if n else 0.0
        out.append({
            "name": prefix + name,
            "shape": tuple(value.shape),
            "std": v.std(unbiased=False).item() if v.numel() > 1 else 0.0,
            "mean": v.mean().item(),
            "grad_std": math.sqrt(max(squares / n - grad_mean * grad_mean, 0.0)) if n else 0.0,
            "grad_mean": grad_mean,
            "max": v.max().item(),
            "min": v.min().item(),
        })
    return out


def _cell(value, width):
    text = "{:.4f}".format(value) if isinstance(value, float) else str(value)
    text = " " + (text[:width - 1] if len(text) + 1 > width else text)
    return text.ljust(width)


def format_summary(summary):
    """The summary as a table: name, shape, max, min, std, mean, grad_std, grad_mean."""
    headers = ["name", "shape", "max", "min", "std", "mean", "grad_std", "grad_mean"]
    widths = [max([len("name")] + [len(item["name"]) for item in summary]) + 4, 20, 10, 10, 10, 10, 10, 10]
    lines = ["".join(_cell(h, w) for h, w in zip(headers, widths))]
    for item in summary:
        lines.append("".join(_cell(item[h], w) for h, w in zip(headers, widths)))
    return "\n".join(lines)
