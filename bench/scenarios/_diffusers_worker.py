"""The direct side of the ``diffusers`` scenario: the worker process
(``run.py --diffusers-worker``) that makes the pipeline calls itself, and
``DirectWorker``, the harness's handle on it (one JSON line each way per sequence).

What is a baseline calls the pipeline directly, on purpose: the segment path's calls
(`_pipeline_sequence`, a deliberate copy of what the engine's segment loop calls, so that
the engine's and the server's overhead can be measured against it) and a family's single
call (whose arguments are the engine's own plan for the same request). Everything else
goes through the engine: its loops make the streamed chunks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from bench import diffusers_tiny
from bench._settings import PROMPT
from bench.scenarios._diffusers_presets import STREAMED, DiffusersPreset, StreamedFamily
from trio_vstream.engines.contract import Checkpoint


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _pipeline_sequence(
    engine: Any, preset: DiffusersPreset, segments: int, seed: int
) -> dict[str, Any]:
    """The pipeline calls the engine makes for one session, made directly and timed.

    As in ``DiffusersStream``: the prompt (and, with guidance, the empty negative prompt)
    encoded once, in the first segment; then per segment one call with those embeddings,
    ``num_frames=segment_frames``, a generator seeded ``seed + index``, ``output_type="pt"``,
    and the engine's conversion to uint8 frames copied to the host. The pipeline object is
    the one the engine loaded (so the same dtypes and device).
    """
    import numpy as np
    import torch

    from trio_vstream.engines.diffusers import _frames_to_uint8

    pipe = engine.model.pipe
    max_sequence_length = engine.model.default("max_sequence_length")
    encode_args: dict[str, Any] = {"do_classifier_free_guidance": False}
    if max_sequence_length is not None:
        encode_args["max_sequence_length"] = max_sequence_length
    threads = _torch_threads()
    times: list[float] = []
    started = time.perf_counter()
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt=PROMPT, **encode_args)
        negative = None
        if preset.guidance_scale > 1.0:
            negative, _ = pipe.encode_prompt(prompt="", **encode_args)
    for index in range(segments):
        output = pipe(
            prompt_embeds=embeds,
            negative_prompt_embeds=negative,
            height=preset.height,
            width=preset.width,
            num_frames=preset.segment_frames,
            num_inference_steps=preset.steps,
            guidance_scale=preset.guidance_scale,
            generator=torch.Generator(device="cpu").manual_seed(seed + index),
            output_type="pt",
        )
        frames = _frames_to_uint8(output.frames)
        host = np.ascontiguousarray(frames[: preset.segment_frames].cpu().numpy())
        assert host.shape == (preset.segment_frames, preset.height, preset.width, 3), host.shape
        ended = time.perf_counter()
        times.append((ended - started) * 1000)
        started = ended
    return {"segment_ms": times, "torch_threads": threads}


def _engine_sequence(
    engine: Any, preset: DiffusersPreset, segments: int, seed: int
) -> dict[str, Any]:
    """The same session through the engine alone (``open_stream`` + ``next_chunk``, no
    server): what the engine adds to the pipeline calls (its lock, scheduler copies)."""
    from trio_vstream.engines import GenerationRequest

    request = GenerationRequest(
        request_id="diffusers-bench",
        prompt=PROMPT,
        width=preset.width,
        height=preset.height,
        fps=16,
        num_frames=segments * preset.segment_frames,
        num_inference_steps=preset.steps,
        guidance_scale=preset.guidance_scale,
        seed=seed,
    )
    times: list[float] = []
    started = time.perf_counter()
    stream = engine.open_stream(request)
    try:
        while stream.next_chunk(Checkpoint()) is not None:
            ended = time.perf_counter()
            times.append((ended - started) * 1000)
            started = ended
    finally:
        stream.close()
    return {"segment_ms": times}


def _streamed_sequence(
    family: StreamedFamily, engine: Any, preset: DiffusersPreset, chunks: int, seed: int
) -> dict[str, Any]:
    """The pipeline's own single call for a ``chunks``-chunk video, timed, then the engine
    streaming the same video: when each of its chunks was done, from ``open_stream``.

    The single call is the baseline, made directly. Its arguments are the engine's for the
    same request (the plan's call arguments: size, steps, guidance, fps, extra_params),
    with the prompt, the whole video's frames and one generator seeded ``seed``, as the
    family's stream draws it: the call whose frames the stream's equal, whatever the
    family."""
    import torch

    request = family.request(preset, chunks, seed)
    stream = engine.open_stream(request)  # plans the request; runs nothing on the pipeline
    try:
        plan = stream.plan
        call = dict(plan.call_kwargs[plan.first.role])
    finally:
        stream.close()
    call.update(
        prompt=request.prompt,
        num_frames=request.num_frames,
        generator=torch.Generator(device="cpu").manual_seed(seed),
        output_type="pt",
    )
    started = time.perf_counter()
    engine.model.pipe(**call)
    whole_ms = (time.perf_counter() - started) * 1000
    times: list[float] = []
    started = time.perf_counter()
    stream = engine.open_stream(request)
    try:
        while stream.next_chunk(Checkpoint()) is not None:
            times.append((time.perf_counter() - started) * 1000)
    finally:
        stream.close()
    return {"whole_call_ms": whole_ms, "chunk_done_ms": times}


def diffusers_worker(config_json: str) -> int:
    """``run.py --diffusers-worker CONFIG``: the "direct" side of the diffusers scenario.

    A process of its own, set up like the server's (allocator settings included): it
    builds the preset's pipeline (if the directory does not exist), loads it with
    ``load_engine`` in its main thread (so ``threads=1`` is set before any other thread
    exists, as the server's command line does), then runs sequences in one worker thread,
    as the server runs its engine, one per JSON line on stdin, each answered by a JSON line
    on stdout. Measuring in a fresh process, not in the harness, keeps the comparison fair:
    the harness's heap, threads and torch settings are not the server's.
    """
    from concurrent.futures import ThreadPoolExecutor

    from trio_vstream.server import memory

    memory.tune_allocator()  # the same allocator settings as the server's command line
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to the log, not into the replies
    config = json.loads(config_json)
    preset = DiffusersPreset.named(config["preset"])
    model = Path(config["model"])
    started = time.perf_counter()
    if not model.exists():
        import diffusers

        diffusers.utils.logging.disable_progress_bar()
        diffusers_tiny.build_wan_t2v(model, size=preset.model)
    build_s = time.perf_counter() - started
    from trio_vstream.engines import load_engine

    engine = load_engine("diffusers", preset.engine_args(model), device=preset.device)
    streamed: dict[str, Any] = {}  # each family's engine, loaded on first use

    def measure(
        family: StreamedFamily, _: Any, preset: DiffusersPreset, chunks: int, seed: int
    ) -> dict[str, Any]:
        if family.key not in streamed:  # built and loaded on first use, in the worker's thread
            path = model.parent / family.directory
            if not path.exists():
                getattr(diffusers_tiny, family.build)(path)
            args = {"model": str(path), "threads": "1", **family.engine_args}
            streamed[family.key] = load_engine("diffusers", args, device=preset.device)
            _streamed_sequence(family, streamed[family.key], preset, 1, seed)  # warm-up
        return _streamed_sequence(family, streamed[family.key], preset, chunks, seed)

    sequences: dict[str, Callable[..., dict[str, Any]]] = {
        "pipeline": _pipeline_sequence,
        "engine": _engine_sequence,
        **{family.key: functools.partial(measure, family) for family in STREAMED},
    }
    with ThreadPoolExecutor(max_workers=1) as thread:
        threads = thread.submit(_torch_threads).result()
        print(
            json.dumps({"ready": True, "build_s": build_s, "torch_threads": threads}), file=replies
        )
        for line in sys.stdin:
            command = json.loads(line)
            try:
                sequence = sequences[command["what"]]
                result = thread.submit(
                    sequence, engine, preset, command["segments"], command["seed"]
                ).result()
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(result), file=replies)
    engine.close()
    for other in streamed.values():
        other.close()
    return 0


class DirectWorker:
    """The ``--diffusers-worker`` process, driven over its stdin and stdout."""

    def __init__(self, command: Sequence[str], log_path: Path) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.process: trio.Process | None = None
        self._buffer = bytearray()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def start(self, timeout: float) -> dict[str, Any]:
        with self.log_path.open("wb") as log:
            self.process = await trio.lowlevel.open_process(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        return await self._reply(timeout)

    async def call(self, timeout: float, **command: Any) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        await self.process.stdin.send_all((json.dumps(command) + "\n").encode())
        return await self._reply(timeout)

    async def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        with trio.move_on_after(timeout):
            while b"\n" not in self._buffer:
                data = await self.process.stdout.receive_some(65536)
                if not data:
                    await self.process.wait()
                    raise RuntimeError(
                        f"diffusers worker exited with status {self.process.returncode}:\n"
                        + self.log_tail()
                    )
                self._buffer += data
            line, _, rest = bytes(self._buffer).partition(b"\n")
            self._buffer = bytearray(rest)
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"diffusers worker: {reply['error']}")
            return reply
        raise RuntimeError(
            f"diffusers worker gave no answer in {timeout:.0f} s:\n{self.log_tail()}"
        )

    async def stop(self, grace: float = 15.0) -> int | None:
        """End of stdin ends the worker; SIGKILL after ``grace`` seconds. Shielded."""
        process = self.process
        if process is None:
            return None
        with trio.CancelScope(shield=True):
            if process.stdin is not None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await process.stdin.aclose()
            with trio.move_on_after(grace):
                await process.wait()
            if process.poll() is None:
                process.kill()
                await process.wait()
        return process.returncode
