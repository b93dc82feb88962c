"""The merge engine: runs a declared merge method on state dicts, importing only that method's module.

A method is a declaration (``mergeflow.schema.merge.MergeMethod``, torch-free, so that params validate
without torch) and a function in its own module, which the declaration names (``implementation``):

- ``scope="tensor"`` (default): a function over the K clients' copies of one tensor
  (``TensorInputs``). The same code then merges in-memory state dicts or tensors streamed
  one by one from safetensors files (``mergeflow.merge.streaming``), by the declaration's
  ``elementwise``, ``masks``, ``gram`` and ``stored``.
- ``scope="model"``: a function over whole models (``ModelInputs``), for methods that couple
  all parameters, such as the exact Gaussian merge (one CG solve over the flattened model).

A notebook declares and registers a method of its own in one go with :func:`merge_method`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel

from mergeflow import cancel
from mergeflow.errors import MergeflowError
from mergeflow.merge.sums import mean
from mergeflow.registry import NoOptions
from mergeflow.schema.merge import DECLARED, UNCOVERED, MergeMethod

State = Mapping[str, torch.Tensor]
Scorer = Callable[[dict[str, torch.Tensor]], float]


@dataclass(frozen=True)
class TensorInputs:
    """One tensor across clients, in float64 (unless stored, below). ``weights`` are n_k/N (uniform without sizes).

    For an elementwise method the streaming merge passes a block of the tensor's elements
    (flattened) instead of the whole tensor. Methods must not modify the tensors in place.
    ``masks`` (``(K, ...)`` booleans) are the method's per-client masks (its declaration's ``masks``),
    drawn from the whole tensor and cut to the same block.
    ``fisher_norms`` (each client's global Fisher L2 norm) is computed on first use only: it
    takes a pass over every Fisher tensor, which most methods never need.
    ``gram`` (``(K, K)`` float64) is the Gram matrix of the whole tensor's K inputs or task vectors, for
    a method declared with ``gram``, whatever block is passed.
    A method declared ``stored`` may be given its tensors as stored (float32 or float64), and
    ``out``, a tensor of the block's shape that it may write its float64 result into, rounded once to
    ``out``'s dtype (float64, or float32: the streamed merge's output itself), and return.
    ``scratch(n)``, when given, is float64 working memory of ``n`` elements (1-D) that a streamed merge
    reuses from tensor to tensor (its contents are not kept): a large temporary made anew per tensor
    costs a page fault per 4 KiB.
    """

    name: str
    tensors: list[torch.Tensor]
    weights: torch.Tensor
    base: torch.Tensor | None = None
    fishers: list[torch.Tensor] | None = None
    norms: Callable[[], torch.Tensor] | None = None
    stack: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    gram: torch.Tensor | None = None
    out: torch.Tensor | None = None
    scratch: Callable[[int], torch.Tensor] | None = None

    @property
    def fisher_norms(self) -> torch.Tensor | None:
        """Global L2 norm of each client's Fisher, or None without Fishers."""
        return self.norms() if self.norms is not None else None

    def stacked(self) -> torch.Tensor:
        """The K tensors as one ``(K, ...)`` tensor: the streaming merge's buffer as is, else a new stack."""
        return self.stack if self.stack is not None else torch.stack(self.tensors)

    def working(self, count: int) -> torch.Tensor:
        """``count`` float64 elements of working memory (1-D) where the tensors are: ``scratch``'s, else new."""
        if self.scratch is not None:
            return self.scratch(count)
        return torch.empty(count, dtype=torch.float64, device=self.tensors[0].device)


@dataclass(frozen=True)
class ModelInputs:
    """Whole client models. ``names`` fixes the flattening order of ``factors`` columns."""

    states: list[dict[str, torch.Tensor]]
    weights: torch.Tensor
    sizes: list[float] | None = None
    base: dict[str, torch.Tensor] | None = None
    fishers: list[dict[str, torch.Tensor]] | None = None
    factors: list[torch.Tensor] | None = None
    names: list[str] = field(default_factory=list)
    grams: list[dict[str, torch.Tensor]] | None = None
    scorer: Scorer | None = None

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The ``names`` tensors concatenated into one float64 vector."""
        return torch.cat([tensors[n].reshape(-1).to(torch.float64) for n in self.names])

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a flat vector back into tensors shaped like the first client's."""
        out, start = {}, 0
        for name in self.names:
            shape = self.states[0][name].shape
            size = self.states[0][name].numel()
            out[name] = vector[start : start + size].reshape(shape)
            start += size
        return out


@dataclass
class MergeResult:
    """A merged state dict plus what the method reports: step curves and scalars."""

    state: dict[str, torch.Tensor]
    curves: dict[str, list[float]] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskOperands:
    """The K clients' tensors and the base, flat and as stored (float32 or float64, one dtype), for a
    compiled mask function that takes the differences θ_k − base itself, a chunk at a time.

    ``every(k, step)``: every ``step``-th element of θ_k and of the base (strided views). ``chunks(clients)``: ``(start,
    [θ_k's part for each k in clients], the base's part)`` in order, each valid until the next: the
    differences of a chunk are taken while the base's part is in cache. Disjoint sets of clients may
    be iterated from different threads at once.
    """

    clients: int
    count: int
    every: Callable[[int, int], tuple[np.ndarray, np.ndarray]]
    chunks: Callable[[Sequence[int]], Iterator[tuple[int, list[np.ndarray], np.ndarray]]]

    @classmethod
    def whole(cls, tensors: Sequence[torch.Tensor], base: torch.Tensor) -> TaskOperands:
        """The operands of tensors in memory (on the CPU): one chunk of everything."""
        xs, bs = [t.reshape(-1).numpy() for t in tensors], base.reshape(-1).numpy()
        return cls(
            len(xs),
            len(bs),
            lambda k, step: (xs[k][::step], bs[::step]),
            lambda clients: iter([(0, [xs[k] for k in clients], bs)]),
        )


class TaskVectors(Sequence[torch.Tensor]):
    """The K task vectors θ_k − base of one tensor (float64), each computed when it is indexed.

    A streamed merge reads client k's tensor only then, into a reused buffer: a vector is valid
    until the next one is asked for, and the mask function may overwrite it. ``device`` is where
    they are, for a mask function that makes tensors without looking at them (DARE's draws).
    ``together``, when the K vectors are in memory anyway, makes all of them as one new ``(K, ...)``
    tensor, for a mask function that selects in all K rows at once. ``operands``, where given, are the
    K tensors and the base as stored (``TaskOperands``), for a compiled mask function that takes the
    differences itself (``sparsify.top_of_differences``). ``out``, where given, is a ``(K, n)`` boolean
    tensor on ``device`` that a mask function may write its masks into (the streamed merge's own).
    """

    def __init__(
        self,
        count: int,
        task: Callable[[int], torch.Tensor],
        device: torch.device | str = "cpu",
        together: Callable[[], torch.Tensor] | None = None,
        operands: TaskOperands | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        self._count = count
        self._task = task
        self.device = torch.device(device)
        self.together = together
        self.operands = operands
        self.out = out

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, k: int) -> torch.Tensor:  # type: ignore[override]
        if not 0 <= k < self._count:
            raise IndexError(k)
        return self._task(k)


# masks(task_vectors, shape, tensor name, options) -> the K per-client masks, one at a time in order.
MaskFunction = Callable[[TaskVectors, tuple[int, ...], str, Any], Iterator[torch.Tensor]]


@dataclass(frozen=True)
class Implementation:
    """A method's code, imported when a merge runs it: its function and its masks function (if declared)."""

    fn: Callable[..., Any]
    masks: MaskFunction | None

    @classmethod
    def of(cls, method: MergeMethod) -> Implementation:
        """``method``'s code, its module imported now."""
        return cls(method.load(), method.load(method.masks) if method.masks else None)


def implementations() -> Callable[[MergeMethod], Implementation]:
    """:meth:`Implementation.of`, remembered for one merge: each method's code is looked up once per merge,
    never across merges (a notebook may register a method again after changing it)."""
    return functools.cache(Implementation.of)


def merge_method(
    name: str,
    *,
    options: type[BaseModel] = NoOptions,
    needs: Collection[str] = (),
    uses: Collection[str] = (),
    models: tuple[int, int | None] = (1, None),
    scope: Literal["tensor", "model"] = "tensor",
    elementwise: bool = False,
    masks: MaskFunction | None = None,
    gram: Literal["inputs", "tasks"] | None = None,
    stored: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare and register a merge method of a notebook or a module of one's own, implemented by the decorated
    function (and ``masks``), which must be defined at the top level of their module.

    The arguments are those of its declaration (``mergeflow.schema.merge.MergeMethod``): ``options`` (a
    pydantic model, extra keys forbidden), ``needs`` (required inputs), ``uses`` (optional ones that the
    pipeline supplies when it has them, e.g. factors), ``models``, ``scope``, ``elementwise``, ``masks``,
    ``gram`` and ``stored``. Tensor scope: ``fn(x: TensorInputs, options) -> tensor``. Model scope:
    ``fn(x: ModelInputs, options) -> MergeResult | dict``. A built-in method is declared in
    ``mergeflow.schema.merge`` instead.
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        declaration = MergeMethod(
            name,
            _reference(fn),
            Options=options,
            needs=frozenset(needs),
            uses=frozenset(uses),
            models=models,
            scope=scope,
            elementwise=elementwise,
            masks=_reference(masks) if masks is not None else None,
            gram=gram,
            stored=stored,
        )
        DECLARED.declare(declaration)
        return fn

    return register


def _reference(fn: Callable[..., Any]) -> str:
    """``"module:attr"`` of a function defined at the top level of its module."""
    if fn.__qualname__ != fn.__name__:
        raise ValueError(f"merge method code must be defined at the top level of a module, not {fn.__qualname__}")
    return f"{fn.__module__}:{fn.__name__}"


def _check_compatible(states: Sequence[State]) -> None:
    reference = states[0]
    for k, state in enumerate(states[1:], start=1):
        if state.keys() != reference.keys():
            missing = sorted(set(reference) ^ set(state))
            raise MergeflowError(f"model {k} has different tensors from model 0: {', '.join(missing[:5])}")
        for key, tensor in state.items():
            if tensor.shape != reference[key].shape:
                raise MergeflowError(
                    f"model {k} tensor {key!r} has shape {tuple(tensor.shape)}, "
                    f"model 0 has {tuple(reference[key].shape)}: the architectures differ"
                )


def normalized_weights(
    sizes: Sequence[float] | None, count: int, device: torch.device | str | None = "cpu"
) -> torch.Tensor:
    """Client weights n_k/N as float64 on ``device`` (uniform when no sizes are given)."""
    if sizes is None:
        return torch.full((count,), 1.0 / count, dtype=torch.float64, device=device)
    if len(sizes) != count:
        raise MergeflowError(f"got {len(sizes)} weights for {count} models")
    if any(s < 0 for s in sizes) or sum(sizes) <= 0:
        raise MergeflowError("merge weights must be non-negative with a positive sum")
    w = torch.as_tensor(sizes, dtype=torch.float64, device=device)
    return w / w.sum()


def states_device(states: Sequence[State]) -> torch.device:
    """The device of the first model's tensors (the CPU for an empty state): where a merge computes."""
    first = next(iter(states[0].values()), None)
    return first.device if first is not None else torch.device("cpu")


def require_inputs(declaration: MergeMethod, given: Mapping[str, object]) -> None:
    """Raise MergeflowError naming the argument when an input that ``declaration`` needs is missing."""
    for need in declaration.needs:
        if given.get(need) is None:
            argument = "weights" if need == "sizes" else need
            raise MergeflowError(f"merge method {declaration.name!r} needs {need} ({argument}=...)")


def merged_tensors(
    declaration: MergeMethod,
    states: Sequence[State],
    base: State | None,
    weights: torch.Tensor,
    fishers: Sequence[State] | None,
    options: BaseModel,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Merge a tensor-scope method one tensor at a time, yielding ``(name, merged)``.

    Only the K clients' copies of the current tensor are held. ``mergeflow.merge.streaming``
    merges files with the same methods and rules (``tensor_method``) without loading them.
    """
    norms = fisher_norms(fishers) if fishers is not None else None
    code = implementations()
    for key in states[0]:
        cancel.check()
        first = states[0][key]
        method = tensor_method(declaration, first.is_floating_point(), fishers is None or key in fishers[0])
        if method is None:
            yield key, first.clone()
            continue
        tensors = [s[key].to(torch.float64) for s in states]
        base_tensor = base[key].to(torch.float64) if base is not None else None
        masks = None
        draw = code(method).masks
        if draw is not None:
            assert base_tensor is not None  # methods with masks need base
            tasks = TaskVectors(
                len(tensors),
                functools.partial(task_vector, tensors, base_tensor),
                base_tensor.device,
                together=functools.partial(task_vectors, tensors, base_tensor),
                operands=TaskOperands.whole(tensors, base_tensor) if base_tensor.device.type == "cpu" else None,
            )
            masks = torch.stack([m.view(first.shape) for m in draw(tasks, tuple(first.shape), key, options)])
        inputs = TensorInputs(
            name=key,
            tensors=tensors,
            weights=weights,
            base=base_tensor,
            fishers=[f[key].to(torch.float64) for f in fishers]
            if fishers is not None and method is declaration
            else None,
            norms=norms,
            masks=masks,
            gram=gram_matrix(torch.stack(tensors), base_tensor, method.gram) if method.gram else None,
        )
        yield key, code(method).fn(inputs, options).to(first.dtype).contiguous()


def gram_matrix(stack: torch.Tensor, base: torch.Tensor | None, kind: str) -> torch.Tensor:
    """The K × K Gram matrix of a ``(K, ...)`` float64 stack (``"inputs"``) or of its task vectors
    ``stack − base`` (``"tasks"``). Summed over blocks of elements, it is the whole tensor's."""
    rows = stack.reshape(len(stack), -1)
    if kind == "tasks":
        assert base is not None  # methods with a task-vector Gram need base
        rows = rows - base.reshape(1, -1)
    return rows @ rows.T


def task_vector(tensors: Sequence[torch.Tensor], base: torch.Tensor, k: int) -> torch.Tensor:
    """θ_k − base, as a new tensor (for ``TaskVectors``)."""
    return tensors[k] - base


def task_vectors(tensors: Sequence[torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """θ_k − base for every k, as one new ``(K, ...)`` tensor (for ``TaskVectors.together``)."""
    return torch.stack(list(tensors)) - base


def tensor_method(declaration: MergeMethod, floating: bool, has_fisher: bool) -> MergeMethod | None:
    """The method that merges one tensor under ``declaration``: None (keep the first model's) for a non-floating
    tensor, ``average`` for a floating one that the given Fishers do not cover, else ``declaration``."""
    if not floating:
        return None
    return declaration if has_fisher else DECLARED[UNCOVERED]


def fisher_norms(fishers: Sequence[State]) -> Callable[[], torch.Tensor]:
    """Each client's global Fisher L2 norm, computed once on first call (a pass over every Fisher tensor)."""

    @functools.cache
    def norms() -> torch.Tensor:
        return torch.stack([torch.sqrt(sum((fd[k].double() ** 2).sum() for k in fd)) for fd in fishers])

    return norms


def _mean(states: Sequence[State], key: str, like: torch.Tensor) -> torch.Tensor:
    return mean([s[key].to(torch.float64) for s in states]).to(like.dtype)


def model_inputs(
    states: Sequence[State],
    *,
    base: State | None = None,
    weights: Sequence[float] | None = None,
    fishers: Sequence[State] | None = None,
    factors: Sequence[torch.Tensor] | None = None,
    grams: Sequence[State] | None = None,
    scorer: Scorer | None = None,
) -> ModelInputs:
    """Whole-model inputs of a model-scope method, checked for compatible architectures.

    Factors keep a floating dtype of their own (float32 factors halve the memory of a
    large model's precision); everything else is float64.
    """
    if not states:
        raise MergeflowError("merge needs at least one model")
    _check_compatible([*states, base] if base is not None else states)
    fisher_list = [dict(f) for f in fishers] if fishers is not None else None
    names = list(fisher_list[0]) if fisher_list else [k for k, v in states[0].items() if v.is_floating_point()]
    return ModelInputs(
        states=[dict(s) for s in states],
        weights=normalized_weights(weights, len(states), states_device(states)),
        sizes=list(weights) if weights is not None else None,
        base=dict(base) if base is not None else None,
        fishers=fisher_list,
        factors=[_factor_tensor(u) for u in factors] if factors is not None else None,
        names=names,
        grams=[{k: v.to(torch.float64) for k, v in g.items()} for g in grams] if grams is not None else None,
        scorer=scorer,
    )


def _factor_tensor(u: torch.Tensor) -> torch.Tensor:
    u = u if isinstance(u, torch.Tensor) else torch.as_tensor(u)  # a tensor stays on its device
    return u if u.dtype in (torch.float32, torch.float64) else u.to(torch.float64)


def run_merge(
    method: str,
    states: Sequence[State],
    *,
    base: State | None = None,
    weights: Sequence[float] | None = None,
    fishers: Sequence[State] | None = None,
    factors: Sequence[torch.Tensor] | None = None,
    grams: Sequence[State] | None = None,
    scorer: Scorer | None = None,
    options: BaseModel | None = None,
    **keywords: object,
) -> MergeResult:
    """Merge client state dicts with a declared method, returning its report too. Its options are ``options``,
    the method's validated options model (``mergeflow.schema.merge.MergeMethod.parse``), or ``keywords``."""
    if not states:
        raise MergeflowError("merge needs at least one model")
    declaration = DECLARED.lookup(method)
    given = {"base": base, "sizes": weights, "fishers": fishers, "factors": factors, "grams": grams, "scorer": scorer}
    require_inputs(declaration, given)
    parsed = parsed_options(declaration, options, keywords)
    if declaration.scope == "tensor":
        _check_compatible([*states, base] if base is not None else states)
        w = normalized_weights(weights, len(states), states_device(states))
        fisher_list = [dict(f) for f in fishers] if fishers is not None else None
        return MergeResult(dict(merged_tensors(declaration, states, base, w, fisher_list, parsed)))
    inputs = model_inputs(
        states, base=base, weights=weights, fishers=fishers, factors=factors, grams=grams, scorer=scorer
    )
    result = Implementation.of(declaration).fn(inputs, parsed)
    if not isinstance(result, MergeResult):
        result = MergeResult(result)
    for key, first in states[0].items():  # untouched tensors (buffers, counters) follow the tensor rules
        if key not in result.state:
            result.state[key] = first.clone() if not first.is_floating_point() else _mean(states, key, first)
        result.state[key] = result.state[key].to(first.dtype).contiguous()
    return result


def parsed_options(declaration: MergeMethod, options: BaseModel | None, keywords: Mapping[str, object]) -> BaseModel:
    """The options of a merge: its validated model as given, or validated from ``keywords`` (a notebook's)."""
    if options is not None and keywords:
        raise MergeflowError(f"give the options of {declaration.name!r} as a model (options=) or as keywords, not both")
    return declaration.parse(options if options is not None else keywords)


def merge(method: str, states: Sequence[State], **inputs: Any) -> dict[str, torch.Tensor]:
    """Merge client state dicts with a declared method; see ``run_merge`` for the inputs.

    Example: ``merge("task_arithmetic", [sd1, sd2], base=sd0, scaling=0.5)``.
    Tensors are combined in float64 and cast back to each tensor's dtype; non-float
    tensors (e.g. counters) are taken from the first model.
    """
    return run_merge(method, states, **inputs).state
