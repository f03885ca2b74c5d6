"""Helpers for the diffusers engine tests: requests, a checkpoint the test stops, and a
`Probe` that watches a pipeline's real modules.

What reaches the models is observed through hooks on the real modules (transformer
calls, VAE decodes, the image handed to the image-to-video pipeline); nothing under test
is mocked. Tests wait for what a probe saw with `Probe.wait_for_forwards` (a condition
the hook notifies), never by polling.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import trio
from trio_websocket import open_websocket_url

from tests.conftest import CLIENT_MAX_MESSAGE, Transcript, receive_into
from trio_vstream.engines import (
    Checkpoint,
    Chunk,
    EngineStream,
    GenerationRequest,
    PromptChange,
    SamplingSettings,
    checkpoint_calling,
)
from trio_vstream.session.session import SessionSummary

START = {
    "type": "session.start",
    "prompt": "a red fox in the snow",
    "size": "48x32",
    "fps": 8,
    "num_inference_steps": 2,
    "seed": 1,
}
"""A session.start the tiny pipeline serves in milliseconds."""

GATE_TIMEOUT = 30.0
"""The longest a gated step waits for the test to open the gate (a failed test must not
leave a thread hanging forever)."""


def request(**fields: Any) -> GenerationRequest:
    """A request for the tiny pipeline: 48x32, 2 steps, no guidance, seed 1.

    Model-family settings (``flow_shift=...``) go into the request's ``sampling``, as a
    session.start's top-level fields do."""
    sampling = {
        name: fields.pop(name) for name in attrs.fields_dict(SamplingSettings) if name in fields
    }
    if sampling:
        fields["sampling"] = SamplingSettings(**sampling)
    values: dict[str, Any] = {
        "request_id": "test",
        "prompt": "a red fox in the snow",
        "width": 48,
        "height": 32,
        "fps": 8,
        "num_frames": 12,
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "seed": 1,
    }
    values.update(fields)
    return GenerationRequest(**values)


no_stop = Checkpoint()
"""A checkpoint that never stops: run a stream to its end."""


def run_all(stream: Any, checkpoint: Checkpoint = no_stop) -> list[Any]:
    """Every chunk of ``stream``, which is closed afterwards (whatever happens)."""
    chunks = []
    try:
        while (chunk := stream.next_chunk(checkpoint)) is not None:
            chunks.append(chunk)
    finally:
        stream.close()
    return chunks


class Stopped(BaseException):
    """Stands in for trio.Cancelled, which checkpoint() raises: a BaseException."""


class StopAtCall:
    """A checkpoint that counts its calls (``calls``) and raises `Stopped` at the call
    numbered ``stop_at`` (0: never): how a test stops an engine at a chosen step."""

    def __init__(self) -> None:
        self.calls = 0
        self.stop_at = 0
        self.checkpoint = checkpoint_calling(self._step)

    def _step(self) -> None:
        self.calls += 1
        if self.stop_at and self.calls >= self.stop_at:
            raise Stopped


class StopWhenTold(Checkpoint):
    """A session's checkpoint that the test stops by setting ``stop``; ``queued`` is set
    once the session waits behind another for the pipeline."""

    def __init__(self) -> None:
        self.queued = threading.Event()
        self.stop = threading.Event()

    def check_cancelled(self) -> None:
        if self.stop.is_set():
            raise Stopped

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self.queued.set()
        yield


class Probe:
    """Watches a pipeline's real modules: every transformer call, every VAE decode.

    ``step_delay`` slows every transformer call down (work for another session to
    overlap with); ``gate``, when given, holds the first transformer call until the test
    sets it, so the test knows the segment holds the pipeline for as long as it needs.
    """

    def __init__(
        self,
        pipe: Any,
        *,
        step_delay: float = 0.0,
        keep_embeds: bool = False,
        gate: threading.Event | None = None,
    ) -> None:
        self.pipe = pipe
        self.forwards: list[tuple[float, int]] = []
        self.decodes: list[tuple[float, int]] = []
        self.embeds: list[torch.Tensor] = []
        self.embed_refs: list[weakref.ref[torch.Tensor]] = []
        self.flow_shifts: list[float | None] = []
        self.images: list[np.ndarray] = []
        self._seen = threading.Condition()

        def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            with self._seen:
                self.forwards.append((time.monotonic(), threading.get_ident()))
                self._seen.notify_all()
            embeds = kwargs["encoder_hidden_states"]
            self.embed_refs.append(weakref.ref(embeds))
            if keep_embeds:
                self.embeds.append(embeds.detach().clone())
            self.flow_shifts.append(pipe.scheduler.config.get("flow_shift"))  # None: no such knob
            if gate is not None:
                gate.wait(GATE_TIMEOUT)
            if step_delay:
                time.sleep(step_delay)  # stands for a slower model, not for synchronisation

        self._hook = pipe.transformer.register_forward_pre_hook(before_forward, with_kwargs=True)
        decode = pipe.vae.decode

        def counting_decode(*args: Any, **kwargs: Any) -> Any:
            self.decodes.append((time.monotonic(), threading.get_ident()))
            return decode(*args, **kwargs)

        pipe.vae.decode = counting_decode
        processor = pipe.video_processor
        preprocess = processor.preprocess

        def recording_preprocess(image: Any, *args: Any, **kwargs: Any) -> Any:
            self.images.append(np.asarray(image).copy())
            return preprocess(image, *args, **kwargs)

        processor.preprocess = recording_preprocess

    def wait_for_forwards(self, count: int, timeout: float = 10.0) -> bool:
        """Block until the transformer has been called ``count`` times (False: timed out)."""
        with self._seen:
            return self._seen.wait_for(lambda: len(self.forwards) >= count, timeout)

    def remove(self) -> None:
        """Take the hooks off the pipeline, which other tests share."""
        self._hook.remove()
        del self.pipe.vae.decode
        del self.pipe.video_processor.preprocess


def live_tensor_bytes() -> int:
    """Bytes of every torch tensor alive in the process (the models' weights, a session's
    history or state, anything leaked): what a memory-flatness test watches. Tensors
    made while the tests were collected are frozen (``tests/conftest.py``) and not
    counted; they never change, so no comparison of two counts sees them."""
    gc.collect()
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance wakes deprecated lazy torch attributes
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                total += obj.untyped_storage().nbytes()
    return total


def encode(pipe: Any, text: str) -> torch.Tensor:
    """A prompt's embedding as the pipeline itself computes it for a call."""
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(
            prompt=text, do_classifier_free_guidance=False, max_sequence_length=512
        )
    return embeds


def memory_per_chunk(
    stream: EngineStream, chunks: int, held: Callable[[], Any], *, to_the_end: bool = True
) -> tuple[list[int], list[Any], list[int]]:
    """Run ``chunks`` chunks of ``stream`` (then, with ``to_the_end``, check it is done)
    and close it. After each chunk, once the chunk itself is dropped: the bytes of every
    live tensor, ``held()`` (what the session says it keeps), and the chunk's frames."""
    sizes: list[int] = []
    kept: list[Any] = []
    frames: list[int] = []
    try:
        for _ in range(chunks):
            chunk = stream.next_chunk(no_stop)
            assert chunk is not None
            frames.append(chunk.frames.shape[0])
            del chunk
            sizes.append(live_tensor_bytes())
            kept.append(held())
        if to_the_end:
            assert stream.next_chunk(no_stop) is None
    finally:
        stream.close()
    return sizes, kept, frames


def take_turns(engine: Any, a: EngineStream, b: EngineStream, chunks: int) -> list[np.ndarray]:
    """Two sessions' streams take ``chunks`` chunks each, alternately, the pipeline free
    between chunks; then both are done. Each one's frames, joined."""
    made: dict[int, list[np.ndarray]] = {id(a): [], id(b): []}
    try:
        for stream in [a, b] * chunks:
            chunk = stream.next_chunk(no_stop)
            assert chunk is not None
            made[id(stream)].append(chunk.frames)
            assert not engine.lock.locked  # the pipeline is free between chunks
        assert a.next_chunk(no_stop) is None and b.next_chunk(no_stop) is None
    finally:
        a.close()
        b.close()
    return [np.concatenate(made[id(a)]), np.concatenate(made[id(b)])]


def fox_to_whale(stream: EngineStream) -> list[Chunk]:
    """A stream asked for "a red fox": after its first chunk, "a blue whale" (event
    ``e1``) over two chunks; every chunk, the first included, until the stream ends."""
    try:
        chunks = [stream.next_chunk(no_stop)]
        stream.interact(PromptChange("e1", "a blue whale", transition_chunks=2))
        while (chunk := stream.next_chunk(no_stop)) is not None:
            chunks.append(chunk)
    finally:
        stream.close()
    assert all(chunk is not None for chunk in chunks)
    return chunks  # type: ignore[return-value]


def assert_fox_to_whale(
    chunks: Sequence[Chunk], used: Sequence[Any], expected: Callable[[str], Any], steps: int
) -> None:
    """`fox_to_whale`'s chunks and the conditioning ``used`` at each step (``steps`` a
    chunk): the fox's (``expected(prompt)``) for the first chunk, half of each for the
    second, the whale's after; ``e1`` starts with the second chunk and completes with the
    third. Conditioning may be a tensor or a tuple of tensors, each blended alike."""
    fox, whale = expected("a red fox"), expected("a blue whale")
    pairs = list(zip(fox, whale, strict=True)) if isinstance(fox, tuple) else [(fox, whale)]
    assert not any(torch.allclose(f, w) for f, w in pairs)

    def mix(a: float) -> Any:
        mixed = tuple(a * f + (1 - a) * w for f, w in pairs)
        return mixed if isinstance(fox, tuple) else mixed[0]

    per_chunk = [fox, mix(0.5)] + [whale] * (len(chunks) - 2)
    targets = [target for target in per_chunk for _ in range(steps)]
    assert len(used) == len(targets)
    for step_used, target in zip(used, targets, strict=True):
        torch.testing.assert_close(step_used, target, rtol=1e-5, atol=1e-6)
    first, second, third = chunks[:3]
    assert (first.started_event_ids, first.active_event_ids) == ((), ())
    assert (second.started_event_ids, second.active_event_ids) == (("e1",), ("e1",))
    assert third.completed_event_ids == ("e1",)


class Summaries(list[SessionSummary]):
    """The server's session summaries, as they come; ``wait_for`` waits for them."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def record(self, summary: SessionSummary) -> None:
        """The server's ``on_session_end`` (called in the server's Trio run)."""
        self.append(summary)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        """Return once ``count`` sessions have ended."""
        while len(self) < count:
            await self._changed.wait()


async def run_session(url: str, start: dict[str, Any]) -> Transcript:
    """One whole session through the server: everything it received."""
    transcript = Transcript()
    async with open_websocket_url(url, max_message_size=CLIENT_MAX_MESSAGE) as ws:
        await ws.send_message(json.dumps(start))
        await receive_into(ws, transcript)
    return transcript


def record_calls(
    monkeypatch: Any, pipe: Any, on_output: Callable[[dict[str, Any], Any], None] | None = None
) -> list[dict[str, Any]]:
    """Every call of ``pipe``'s class from now on, as the keyword arguments it was given
    (the image as an array, the generator as its seed); the real ``__call__`` then runs,
    and ``on_output(seen, output)`` may keep something of what it returned.
    ``monkeypatch`` (pytest's) puts the class back after the test."""
    calls: list[dict[str, Any]] = []
    cls = type(pipe)
    call = cls.__call__

    @functools.wraps(call)
    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = dict(kwargs)
        if "image" in seen:
            seen["image"] = np.asarray(seen["image"]).copy()
        if seen.get("generator") is not None:
            seen["generator"] = seen["generator"].initial_seed()
        calls.append(seen)
        output = call(self, *args, **kwargs)
        if on_output is not None:
            on_output(seen, output)
        return output

    monkeypatch.setattr(cls, "__call__", recording)
    return calls
