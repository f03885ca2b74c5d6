"""Pipeline calls whose transformer forwards are batched across sessions (`BatchedCall`).

The families served by whole pipeline calls (Wan-style segments, Helios history chunks)
cannot take their steps out of the call: the call's own loop draws the noise, steps the
scheduler, applies guidance and decodes. So each session runs the pipeline's own
``__call__`` in its own thread, on a shallow copy of the shared pipeline (the call's
per-call attributes, ``_guidance_scale``, ``_current_timestep``, ``_interrupt``, and its
scheduler are then the session's), whose components are stand-ins:

* the transformer (and Wan 2.2's ``transformer_2``) is a `_TransformerStandIn`: attribute
  reads go to the real module (dtype, config, device), its ``cache_context`` only notes
  the name, and calling it hands the forward's arguments, as one row, to the session's
  ``step`` (`trio_vstream.engines.batched`). The batch (`CallGroup`) runs the real module once over
  every row that agrees on what must agree (`row_key`), under the engine's lock with the
  group's LoRA active, and gives each row its slice of the output.
* the VAE, the text encoder and the image encoder are `_LockedStandIn`: each call of
  their work methods leaves the batch first (a session decoding holds no batch up), then
  runs under a lock. The VAE takes the engine's ``decode_lock``: a Wan VAE keeps its
  causal caches on the module (``_feat_map``, ``_enc_feat_map``), so two sessions'
  encodes and decodes must never overlap. The encoders take the engine's ``lock``, as
  the engine's own prompt encoding does.

A session joins its batch at its first forward and leaves it at the first VAE or
encoder call after it (or when the call ends, however it ends): it is inside
``batched`` only while it steps. Classifier-free guidance stays the call's:
Wan and Helios make two forwards a step, the conditional and then the unconditional one,
so each is a row, and a batch holds one pass of each session (the conditional and the
unconditional pass of different sessions share a forward when their shapes agree, as
they are the same computation on other embeddings). A lone session's call makes two
forwards of one a step, as it always did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from trio_vstream.engines.contract import Checkpoint, EngineError, batched
from trio_vstream.engines.diffusers.loops._batch import ModelGroup

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers import DiffusersEngine
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._lock import SegmentLock
    from trio_vstream.engines.diffusers._lora import LoadedLora

BATCHING_TRANSFORMERS: frozenset[str] = frozenset(
    {"WanTransformer3DModel", "HeliosTransformer3DModel"}
)
"""Transformer classes whose forward is known to take a batch of rows made of batch-of-one
calls: every tensor argument per row along dim 0 (Helios' frame indices too: its rotary
embedding is computed per row), the output per row along dim 0. Another pipeline served
by a call per chunk (LTX, CogVideoX, FramePack inverted, SANA-WM) runs its calls alone."""

TRANSFORMERS: tuple[str, ...] = ("transformer", "transformer_2")
"""The components a call's denoising forwards go through (Wan 2.2 has two experts)."""

LOCKED_PARTS: Mapping[str, tuple[str, ...]] = {
    "vae": ("encode", "decode", "forward", "tiled_encode", "tiled_decode"),
    "text_encoder": ("forward",),
    "image_encoder": ("forward",),
}
"""The other components a call may run, and the methods that do work on them."""


def batchable(info: PipelineInfo) -> bool:
    """Whether ``info``'s calls can have their forwards batched: each of its transformers
    is of a class known to batch (`BATCHING_TRANSFORMERS`)."""
    pipe = info.pipe
    found = [getattr(pipe, name, None) for name in TRANSFORMERS]
    modules = [m for m in found if m is not None]
    return bool(modules) and all(type(m).__name__ in BATCHING_TRANSFORMERS for m in modules)


@attrs.frozen(eq=False)
class CallRow:
    """One forward of one session's call: the real module, the cache context it was called
    in, and the arguments of a batch of one."""

    module: Any
    context: str | None
    kwargs: dict[str, Any]
    key: Hashable
    """`row_key`: rows with equal keys run in one forward."""
    deferred: int = 0
    """How many batches in a row have put this forward off (`CallGroup`)."""


DEFERRED = object()
"""A row's result when its batch put it off: the session hands the same row again."""

MAX_DEFERRED = 2
"""The most batches in a row that may put a forward off: a row waits that long at most
for others to reach its key."""


_ALONE = object()


def row_key(module: Any, context: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What rows must share to run in one forward, or None for a row that runs alone.

    The module (and the cache context, ``cond`` or ``uncond``, only where the module has
    diffusers hooks that read it, `stateful_hooks`: the conditional and the unconditional
    pass are the same computation on other embeddings, and a session one pass ahead of
    another must not keep the two apart for the rest of their calls); for each tensor
    argument its name, shape, dtype and device, the shape a batch of one (dim 0 is 1:
    rows are joined along it); every other argument equal, as a value that can be
    compared (None, a number, a string, a tuple of those). A row runs alone when an
    argument cannot be joined or compared: positional arguments, a tensor whose dim 0 is
    not 1, a dict (a request's ``attention_kwargs``, which would apply to the whole
    forward)."""
    if args:
        return None
    parts: list[Any] = [id(module), context if stateful_hooks(module) else None]
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != 1:
                return None
            parts.append((name, tuple(value.shape), str(value.dtype), str(value.device)))
            continue
        frozen = _frozen(value)
        if frozen is _ALONE:
            return None
        parts.append((name, frozen))
    return tuple(parts)


def stateful_hooks(module: Any) -> bool:
    """Whether ``module`` has diffusers hooks that keep state per cache context (a
    first-block or TeaCache cache): the engine installs none, but a pipeline may come so."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None:
        return False
    registries = (registry, *registry._get_child_registries())
    return any(hook._is_stateful for child in registries for hook in child.hooks.values())


def _frozen(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        items = [_frozen(item) for item in value]
        return _ALONE if any(item is _ALONE for item in items) else (type(value).__name__, *items)
    return _ALONE


class CallGroup(ModelGroup[Hashable]):
    """The batched forward of the calls of one pipeline and one LoRA (``run_batch``).

    Each session's call builds its own and hands it over with its key (the role, the
    call's shape, the LoRA): the server's batcher batches the rows of equal keys, and a
    batch runs the first row's group, which is interchangeable with the others of its key
    (references to the same engine, pipeline and LoRA). It has no ``attention_kwargs`` of
    its own: a row's forward arguments are the
    call's. Called with some rows, it takes the pipeline's lock, puts the group's LoRA on
    the pipeline (`ModelGroup.locked`), and runs one forward per set of rows with equal
    keys (`row_key`): usually one, a pass of every session. Where rows differ (a Wan 2.2
    session at its other expert, a Helios pyramid session at another stage, another
    resolution), it runs the largest set and puts the others off for a batch or two
    (`_running`). Each row gets its own slice of the output; a forward that fails fails
    its own rows only."""

    def __call__(self, rows: Sequence[CallRow]) -> list[Any]:
        parts: dict[Any, list[int]] = {}
        for i, row in enumerate(rows):
            key = ("alone", i) if row.key is None else row.key
            parts.setdefault(key, []).append(i)
        results: list[Any] = [DEFERRED] * len(rows)
        running = _running(rows, list(parts.values()))
        with self.locked():
            for indices in running:
                members = [rows[i] for i in indices]
                try:
                    outputs = _forward(members)
                except Exception as error:  # fails these rows only, not the batch
                    outputs = [error] * len(members)
                for i, output in zip(indices, outputs, strict=True):
                    results[i] = output
        return results


def _running(rows: Sequence[CallRow], parts: list[list[int]]) -> list[list[int]]:
    """The sets of rows (indices, one set per key) a batch runs now; it puts the others off.

    Sessions in one group step in lockstep (a batch waits for a row of each), so two
    sessions a stage apart (Helios' pyramid stages at their own resolutions, Wan 2.2's two
    experts) would stay a stage apart, their rows never in one forward. So where rows
    differ, the batch runs the largest set (on a tie, the one put off most, then the
    oldest) and puts the others off: their sessions hand the same rows again, and the
    sessions behind catch up. Never more than `MAX_DEFERRED` batches in a row, and never
    a row that can share no forward (no key): those run now, in forwards of their own."""
    if len(parts) == 1:
        return parts
    best = max(
        parts,
        key=lambda part: (len(part), max(rows[i].deferred for i in part), -part[0]),
    )
    return [
        part
        for part in parts
        if part is best
        or rows[part[0]].key is None
        or any(rows[i].deferred >= MAX_DEFERRED for i in part)
    ]


def _forward(rows: Sequence[CallRow]) -> list[Any]:
    """One forward of the module over ``rows`` (equal keys), each row's slice of its output."""
    first = rows[0]
    module = first.module
    if len(rows) == 1:
        kwargs = first.kwargs
    else:
        kwargs = {
            name: torch.cat([row.kwargs[name] for row in rows])
            if isinstance(value, torch.Tensor)
            else value
            for name, value in first.kwargs.items()
        }
    # The rows' context where they share one (always, for a module with hooks: it is in
    # their key); none for a forward of conditional and unconditional rows together.
    contexts = {row.context for row in rows}
    context = contexts.pop() if len(contexts) == 1 else None
    scope = (
        module.cache_context(context)
        if context is not None and hasattr(module, "cache_context")
        else contextlib.nullcontext()
    )
    with scope:
        output = module(**kwargs)
    if len(rows) == 1:
        return [output]
    return [_row_of(output, i, len(rows)) for i in range(len(rows))]


def _row_of(output: Any, index: int, count: int) -> Any:
    """Row ``index`` of a forward's output over ``count`` rows: each tensor's slice along
    dim 0 (a copy, not a view keeping the batch's output alive), the structure kept."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != count:
            raise EngineError(f"a batched forward returned a tensor of shape {tuple(output.shape)}")
        return output[index : index + 1].clone()
    if isinstance(output, dict):  # a ModelOutput (an OrderedDict): rebuilt with its fields
        return type(output)(**{k: _row_of(v, index, count) for k, v in output.items()})
    if isinstance(output, (tuple, list)):
        return type(output)(_row_of(item, index, count) for item in output)
    return output


class BatchedCall:
    """One session's pipeline call with its forwards batched: the pipeline it calls
    (`pipe`, a shallow copy of the shared one with stand-ins for its components), and its
    place in the batch (joined at its first forward, left at its first other work).

    Its group (`CallGroup`) is that of the calls of the same pipeline, LoRA and ``shape``
    (the video's size and the call's frames): calls of another size could share no
    forward, so their sessions do not wait for one another's rows.

    Use it in the session's thread only, and close it when the call ends (`running`)."""

    def __init__(
        self,
        engine: DiffusersEngine,
        info: PipelineInfo,
        checkpoint: Checkpoint,
        lora: tuple[LoadedLora, float] | None,
        scheduler: Any,
        config_overrides: Mapping[str, Any],
        shape: Hashable,
    ) -> None:
        self._engine = engine
        self._info = info
        self._checkpoint = checkpoint
        self._lora = lora
        self._shape = shape
        self._batch: contextlib.ExitStack | None = None
        self._step: Any = None
        self.forwards = 0
        """Forwards handed to the batch so far (for the log and tests)."""
        shared = info.pipe
        pipe: Any = object.__new__(_copy_class(type(shared)))
        # Plain dict writes: a pipeline's __setattr__ would register a component's class in
        # its config, and a stand-in has none.
        pipe.__dict__.update(shared.__dict__)
        pipe.__dict__["_batched_call_shared"] = shared
        for name in TRANSFORMERS:
            module = shared.__dict__.get(name)
            if module is not None:
                pipe.__dict__[name] = _TransformerStandIn(module, self)
        for name, methods in LOCKED_PARTS.items():
            module = shared.__dict__.get(name)
            if module is not None:
                lock = engine.decode_lock if name == "vae" else engine.lock
                pipe.__dict__[name] = _LockedStandIn(module, self, lock, methods)
        if scheduler is not None:
            pipe.__dict__["scheduler"] = scheduler
        if config_overrides:
            pipe.register_to_config(**config_overrides)  # the copy's config, not the shared one
        self.pipe: Any = pipe

    @contextlib.contextmanager
    def running(self) -> Iterator[Any]:
        """The call's pipeline, for one call; the batch is left however the call ends, and
        the copy let go (its stand-ins point back here: no cycle outlives the call)."""
        try:
            yield self.pipe
        finally:
            self.leave()
            self.pipe = None

    def forward(self, module: Any, context: str | None, args: tuple[Any, ...], kwargs: Any) -> Any:
        """One forward of ``module``, as a row of the session's batch."""
        if args:
            raise EngineError("a batched pipeline call passed positional arguments to its model")
        if self._step is None:
            self._join()
        row = CallRow(module, context, dict(kwargs), row_key(module, context, args, kwargs))
        self.forwards += 1
        while True:
            result = self._step(row)
            if result is not DEFERRED:
                return result
            row = attrs.evolve(row, deferred=row.deferred + 1)  # the same forward, again

    def leave(self) -> None:
        """Leave the batch (the session has other work than forwards to do)."""
        batch, self._batch, self._step = self._batch, None, None
        if batch is not None:
            batch.close()

    @contextlib.contextmanager
    def locked(self, lock: SegmentLock) -> Iterator[None]:
        """Out of the batch, under ``lock``: a component's work beside the batches."""
        self.leave()
        with lock.held(self._checkpoint):
            yield

    def _join(self) -> None:
        engine, info, lora = self._engine, self._info, self._lora
        key = (
            "calls",
            info.role,
            self._shape,
            None if lora is None else (lora[0].adapter, lora[1]),
        )
        group = CallGroup(engine, info, key, lora)
        stack = contextlib.ExitStack()
        self._step = stack.enter_context(batched(self._checkpoint, group, key))
        self._batch = stack


_COPY_CLASSES: dict[type, type] = {}


def _copy_class(cls: type) -> type:
    """``cls`` with the pipeline's device and dtype read from the shared pipeline: a
    pipeline finds them among its components that are modules, and a copy's are stand-ins
    (which are not). One subclass per pipeline class, named as it is."""
    made = _COPY_CLASSES.get(cls)
    if made is None:

        def shared(self: Any) -> Any:
            return self.__dict__["_batched_call_shared"]

        made = type(
            cls.__name__,
            (cls,),
            {
                "__module__": cls.__module__,
                "__doc__": cls.__doc__,
                "device": property(lambda self: shared(self).device),
                "_execution_device": property(lambda self: shared(self)._execution_device),
                "dtype": property(lambda self: shared(self).dtype),
            },
        )
        made = _COPY_CLASSES.setdefault(cls, made)
    return made


class _TransformerStandIn:
    """The transformer as the session's call sees it: the real module for everything but
    its forward, which goes to the batch (`BatchedCall.forward`)."""

    def __init__(self, module: Any, call: BatchedCall) -> None:
        self._module = module
        self._call = call
        self._context: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call.forward(self._module, self._context, args, kwargs)

    forward = __call__

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs: Any) -> Iterator[None]:
        """Noted for the row: the batch enters the real one (by name) around its forward.
        The step index and sigma it may be given differ per row; they only feed cache
        hooks, which the engine does not install."""
        self._context, before = name, self._context
        try:
            yield
        finally:
            self._context = before

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        """Nothing: the call's end would reset the shared module's cache hooks while other
        sessions' forwards run."""


class _LockedStandIn:
    """A component whose work methods run out of the batch and under a lock."""

    def __init__(
        self, module: Any, call: BatchedCall, lock: SegmentLock, methods: tuple[str, ...]
    ) -> None:
        self._module = module
        self._call = call
        self._lock = lock
        self._methods = methods

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._module, name)
        if name in self._methods:
            call, lock = self._call, self._lock

            def locked(*args: Any, **kwargs: Any) -> Any:
                with call.locked(lock):
                    return attribute(*args, **kwargs)

            return locked
        return attribute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._call.locked(self._lock):
            return self._module(*args, **kwargs)
