"""A step exported as one graph per batch bucket (torch.export) and replayed on later steps.

A bucket (lib/records/addressing.py StepShape) fixes every shape of a step: the padded sequences,
the new tokens per sequence and the read widths of `max_len` positions. PagedCache.address(...,
shape) builds a step's inputs at those shapes, so every per-step fact (tokens, positions, logit
rows, slots, block tables, entry writes, the step's rows) is a tensor input. The pools, parameters
and RoPE tables are inputs as well: the graph writes the pools in place as eager does, and holds
no copy of a weight. What the graph keeps constant (the config, the layer schedule, the address
functions, the addressing's host ints) is compared with what was traced - the batch's on every
replay, the parameters', pools' and tables' once per object (they are the same objects on every
step, and a Flash model has thousands of leaves: host time a replay must not spend) - so a step
the graph does not fit is refused with the difference named, never run wrong.

On a device the exported program is captured with the device's graph API (torch.npu.NPUGraph,
CUDA / HIP graphs): static shapes and addresses, nothing read back by the host (the capability
guard proves it of the forward); a replay copies the step's tensors into the captured inputs
(pools and parameters are the captured ones already) and replays the kernels. On CPU the
exported program is the replayed graph.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lib.records.addressing import StepShape
from lib.records.batch import Batch


_PARTS = ("parameters", "batch inputs", "pools", "RoPE tables")
_BATCH = 1                                                     # the part that changes every step


class StepGraph:
    """The generated forward of `model` over the pools of `store`, exported for one bucket."""

    def __init__(self, model, store, shape: StepShape):
        self.shape, self._model = shape, model
        blank = Batch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), (), ())
        leaves, self._spec = tree_flatten(_inputs(model, store.address(blank, [], shape), store))
        self._tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self._tensor_set = frozenset(self._tensor_at)
        self._constants = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        self._signature = {i: (leaves[i].shape, leaves[i].dtype) for i in self._tensor_at}
        self._part_specs = self._spec.children()              # parameters, batch, pools, RoPE tables
        self._held: dict[int, tuple] = {}                      # part -> (the object, its checked leaves)
        step = _Step(model, self._spec, self._constants, self._tensor_at)
        example = tuple(leaves[i] for i in self._tensor_at)
        with torch.no_grad():
            self.program = torch.export.export(step, example, strict=False)
        self._replay = self.program.module()
        api = device_graph_api(store.device)
        per_step = _batch_leaves(self._spec)
        self._captured = None if api is None else _Captured(api, self._replay, example,
                                                            [i in per_step for i in self._tensor_at])

    def __call__(self, batch: Batch, store) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, main_hidden) of every row of `batch`, addressed by `store.address(..., self.shape)`."""
        if batch.logit_rows is not None:
            raise ValueError(f"step graph {self.shape}: it computes the logits of every row; pick rows from them")
        tensors = self._tensors(_inputs(self._model, batch, store))
        with torch.no_grad():
            if self._captured is not None:
                return self._captured.replay(tensors)
            return self._replay(*tensors)

    def _tensors(self, parts: tuple) -> list:
        """The graph's tensor inputs, each part (parameters, batch, pools, RoPE) checked against the traced
        layout. The parameters, pools and RoPE tables are the same objects on every step of a model and a
        cache: each is flattened and checked once, when first seen, and its tensors reused while it is the
        object given (a replay's host work is then the batch's few dozen leaves, not the model's thousands)."""
        leaves, at = [], 0
        for k, (part, spec) in enumerate(zip(parts, self._part_specs)):
            known = self._held.get(k)
            if known is not None and known[0] is part:
                leaves += known[1]
            else:
                flat, got = tree_flatten(part)
                if got != spec:
                    raise ValueError(f"step graph {self.shape}: the step's {_PARTS[k]} are laid out differently "
                                     "from the traced ones (address the batch with this bucket's shape)")
                self._check(flat, at)
                leaves += flat
                if k != _BATCH:
                    self._held[k] = (part, flat)
            at += spec.num_leaves
        return [leaves[i] for i in self._tensor_at]

    def _check(self, flat: list, at: int) -> None:
        """Refuse leaves (the inputs' leaves from index `at` on) that are not what was traced there."""
        for i, value in enumerate(flat, at):
            traced = self._constants[i]
            if isinstance(value, torch.Tensor) != (i in self._tensor_set):
                raise ValueError(f"step graph {self.shape}: input {_path(self._spec, i)} is {type(value).__name__}, "
                                 f"the graph was traced with {'a tensor' if i in self._tensor_set else repr(traced)}")
            if not isinstance(value, torch.Tensor):
                if value != traced:
                    raise ValueError(f"step graph {self.shape}: input {_path(self._spec, i)} is {value!r}, the graph "
                                     f"was traced with {traced!r}")
            elif (value.shape, value.dtype) != self._signature[i]:
                shape, dtype = self._signature[i]
                raise ValueError(f"step graph {self.shape}: input {_path(self._spec, i)} is {value.dtype} "
                                 f"{list(value.shape)}, the graph takes {dtype} {list(shape)}")


def device_graph_api(device):
    """The graph API of the stack `device` belongs to (torch.npu with torch_npu, torch.cuda for CUDA and
    ROCm / HIP), or None: CPU, where the exported program is the replay."""
    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "npu":
        return getattr(torch, "npu", None)
    return torch.cuda if kind == "cuda" else None


class _Captured:
    """An exported step captured once with a device graph API and replayed with new inputs.

    Captured inputs: the example's own tensors, so the pools and parameters (the same tensors on every
    step) are read and written where they live; a step's other tensors are copied into them first."""

    def __init__(self, api, run, example: tuple, per_step: list[bool]):
        self._inputs = tuple(t.clone() if mine else t for t, mine in zip(example, per_step))
        stream = api.Stream()
        stream.wait_stream(api.current_stream())
        with api.stream(stream):
            run(*self._inputs)                      # warm-up outside the capture (allocator, lazy init)
        api.current_stream().wait_stream(stream)
        graph = api.NPUGraph() if hasattr(api, "NPUGraph") else api.CUDAGraph()
        with api.graph(graph):
            self._outputs = run(*self._inputs)
        self._graph = graph

    def replay(self, tensors: list):
        for held, new in zip(self._inputs, tensors):
            if new is not held:
                held.copy_(new)
        self._graph.replay()
        return tuple(None if t is None else t.clone() for t in self._outputs)


def _batch_leaves(spec) -> frozenset[int]:
    """Indices of the leaves that belong to the batch (a step's own tensors), not to the parameters,
    pools or RoPE tables."""
    return frozenset(i for i, path in enumerate(_leaf_paths(spec)) if path[0].idx == 1)


def _leaf_paths(spec) -> list:
    """The key path of every leaf of the inputs, in leaf order."""
    from torch.utils._pytree import tree_flatten_with_path
    dummy = tree_unflatten(list(range(spec.num_leaves)), spec)
    return [path for path, _ in sorted(tree_flatten_with_path(dummy)[0], key=lambda item: item[1])]


class _Step(torch.nn.Module):
    """forward(*tensor inputs) -> (logits, main_hidden): the generated forward, its constants baked in."""

    def __init__(self, model, spec, constants, tensor_at):
        super().__init__()
        self._model, self._spec, self._constants, self._tensor_at = model, spec, constants, tensor_at

    def forward(self, *tensors):
        leaves = list(self._constants)
        for i, t in zip(self._tensor_at, tensors):
            leaves[i] = t
        params, batch, pools, rope = tree_unflatten(leaves, self._spec)
        logits, _, hidden = self._model.forward(params, batch, pools, self._model.cfg, rope)
        return logits, hidden


def _inputs(model, batch: Batch, store):
    """What the graph takes: parameters, the batch (its host-side `starts` blanked: no op reads them, and a
    graph must not depend on them), the pools and the RoPE tables."""
    return model.params, batch._replace(starts=(0,) * len(batch.starts)), store.layers, model.rope


def _path(spec, index: int) -> str:
    """A readable name of leaf `index` of the inputs."""
    from torch.utils._pytree import keystr
    path = _leaf_paths(spec)[index]
    return ("params", "batch", "pools", "rope")[path[0].idx] + keystr(path[1:])
