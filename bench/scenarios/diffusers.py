"""``diffusers`` (where diffusers is installed): a random Wan pipeline, built in a
temporary directory and served by ``--engine diffusers``: the server's time per segment
(and TTFC, delivered fps) against the same pipeline calls made directly, in a process of
their own (``run.py --diffusers-worker``); and each family the engine streams exactly
(`STREAMED`: Helios chunks, SkyReels-V2 DF windows), its first chunk against the
pipeline's own single call for the whole video.

What is a baseline calls the pipeline directly, on purpose: the segment path's calls
(`_pipeline_sequence`, a deliberate copy of what the engine's segment loop calls, so that
the engine's and the server's overhead can be measured against it) and a family's single
call (whose arguments are the engine's own plan for the same request). Everything else
goes through the engine: its loops make the streamed chunks.

Over 800 lines, over the package's usual size: the presets, the worker process and the
scenario are one measurement (the worker must make exactly the calls the engine makes, and
the scenario drives both sides), and reading them apart would hide that.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from bench import diffusers_tiny
from bench._client import SessionClient, report_failures, run_clients
from bench._context import RunContext
from bench._output import now, progress
from bench._server import Endpoint, ServerProcess, cpu_seconds, fetch_stats, minor_faults
from bench._settings import BENCH_DIR, PROMPT, Settings, Target, make_target
from bench._stats import CATALOGUE, Figures, percentile
from trio_vstream import protocol
from trio_vstream.engines.contract import Checkpoint


def diffusers_available() -> bool:
    """Whether the ``diffusers`` scenario can run here (it needs the optional extra)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("diffusers", "transformers"))


DIFFUSERS_PRESETS: Final = ("tiny", "cpu", "gpu")
DIFFUSERS_OVERHEAD_LIMIT_PCT: Final = 5.0
CHUNKED_FIRST_CHUNK_SLACK: Final = 1.5
"""How far over 1/k the chunked first-chunk fraction may be (its own decode, noise)."""


@attrs.frozen(kw_only=True)
class DiffusersPreset:
    """A random Wan pipeline and the request the scenario sends it: every segment is one
    pipeline call of ``segment_frames`` frames and ``steps`` denoising steps, with
    classifier-free guidance (two transformer passes per step), as Wan is run."""

    name: str
    device: str
    model: diffusers_tiny.WanSize
    """The transformer's and the VAE's shape."""
    width: int
    height: int
    segment_frames: int
    steps: int
    guidance_scale: float = 5.0

    @classmethod
    def named(cls, name: str) -> DiffusersPreset:
        if name == "tiny":  # the tests' pipeline, milliseconds per call: for --quick
            return cls(
                name=name,
                device="cpu",
                model=diffusers_tiny.TINY,
                width=48,
                height=32,
                segment_frames=5,
                steps=2,
            )
        if name == "cpu":  # a few hundred ms per segment on one core
            model = diffusers_tiny.WanSize(
                layers=4,
                heads=4,
                head_dim=32,
                ffn_dim=512,
                rope_max_seq_len=1024,
                vae_base_dim=3,
                vae_dim_mult=(1, 1, 1, 1),
                vae_res_blocks=1,
            )
            return cls(
                name=name,
                device="cpu",
                model=model,
                width=128,
                height=96,
                segment_frames=17,
                steps=4,
            )
        if name == "gpu":  # Wan 2.1 1.3B's widths and VAE, 10 of its 30 blocks, at 480p
            model = diffusers_tiny.WanSize(
                layers=10,
                heads=12,
                head_dim=128,
                ffn_dim=8960,
                rope_max_seq_len=1024,
                vae_base_dim=96,
                vae_dim_mult=(1, 2, 4, 4),
                vae_res_blocks=2,
            )
            return cls(
                name=name,
                device="cuda",
                model=model,
                width=832,
                height=480,
                segment_frames=17,
                steps=4,
            )
        raise ValueError(f"unknown diffusers preset {name!r}: use {', '.join(DIFFUSERS_PRESETS)}")

    @classmethod
    def default(cls, quick: bool) -> DiffusersPreset:
        """--quick: tiny; otherwise gpu where CUDA is available, else cpu."""
        if quick:
            return cls.named("tiny")
        import torch

        return cls.named("gpu" if torch.cuda.is_available() else "cpu")

    def engine_args(self, model: Path) -> dict[str, str]:
        return {"model": str(model), "threads": "1", "segment_frames": str(self.segment_frames)}

    def start_fields(self, num_frames: int, seed: int) -> dict[str, Any]:
        return {
            "size": f"{self.width}x{self.height}",
            "fps": 16,
            "num_frames": num_frames,
            "num_inference_steps": self.steps,
            "guidance_scale": self.guidance_scale,
            "seed": seed,
        }


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


@attrs.frozen(kw_only=True)
class StreamedFamily:
    """A family the engine streams exactly (its frames are the pipeline's single call's),
    measured against that single call: the first chunk should come after about 1/k of
    the call's time for a k-chunk video. A random pipeline of the family is built in the
    worker's directory; the request makes k chunks of even work."""

    key: str
    """The figures' prefix (``diffusers.<key>.*``) and the worker's command."""
    label: str
    """The pipeline, as the figures' descriptions name it."""
    unit: str
    """What the family calls a chunk: ``chunk``, ``window``."""
    target: str
    """The verdict's name."""
    build: str
    """The ``diffusers_tiny`` builder of its random pipeline."""
    directory: str
    size: int
    """The frames' width and height."""
    first_frames: int
    """The first chunk's frames."""
    later_frames: int
    """Each later chunk's new frames."""
    engine_args: dict[str, str] = attrs.field(factory=dict)
    extra_params: dict[str, Any] = attrs.field(factory=dict)

    def request(self, preset: DiffusersPreset, chunks: int, seed: int) -> Any:
        """The request for a ``chunks``-chunk video."""
        from trio_vstream.engines import GenerationRequest

        return GenerationRequest(
            request_id=f"diffusers-bench-{self.key}",
            extra_params=dict(self.extra_params),
            prompt=PROMPT,
            width=self.size,
            height=self.size,
            fps=16,
            num_frames=self.first_frames + self.later_frames * (chunks - 1),
            num_inference_steps=preset.steps,
            guidance_scale=1.0,
            seed=seed,
        )


FORCING_WINDOW_FRAMES: Final = 17
"""SkyReels-V2 DF's window (``segment_frames``, the call's ``base_num_frames``): 5 latent
frames. With one latent frame of overlap, each later window adds 4 latent frames (16
frames), about as much as the first (17): then the windows are even work and 1/k is the
ideal."""

STREAMED: Final = (
    StreamedFamily(
        key="chunked",
        label="random Helios",
        unit="chunk",
        target="diffusers: chunked first chunk",
        build="build_helios",
        directory="Helios-random-tiny",
        size=64,  # the smallest the tiny Helios takes
        first_frames=33,  # its chunk: 9 latent frames, the engine's segment_frames
        later_frames=33,
    ),
    StreamedFamily(
        key="forcing",
        label="random SkyReels-V2 DF",
        unit="window",
        target="diffusers: diffusion-forcing first window",
        build="build_skyreels_df",
        directory="SkyReels-DF-random-tiny",
        size=32,
        first_frames=FORCING_WINDOW_FRAMES,
        later_frames=FORCING_WINDOW_FRAMES - 1,
        engine_args={"segment_frames": str(FORCING_WINDOW_FRAMES)},
        # The window is given too, so the engine's plan holds the single call's arguments.
        extra_params={"overlap_history": 1, "base_num_frames": FORCING_WINDOW_FRAMES},
    ),
)
"""The families measured streamed against their single call."""

for _family in STREAMED:  # their figures, declared beside them (bench/_stats.py is shared)
    CATALOGUE.update(
        {
            f"diffusers.{_family.key}.whole_call_ms": (
                "ms",
                f"{_family.label}: the pipeline's single call for the whole k-{_family.unit} video",
            ),
            f"diffusers.{_family.key}.first_chunk_ms": (
                "ms",
                f"{_family.label} streamed by the engine: open_stream -> first {_family.unit}",
            ),
            f"diffusers.{_family.key}.streamed_total_ms": (
                "ms",
                f"{_family.label} streamed by the engine: open_stream -> last {_family.unit}",
            ),
            f"diffusers.{_family.key}.first_chunk_fraction": (
                "ratio",
                f"{_family.label}: first streamed {_family.unit} / single call for the whole "
                "video (ideal 1/k)",
            ),
        }
    )


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


def _steady_fps(times_ms: Sequence[float], frames: int) -> float:
    """Frames per second over the segments after the first."""
    steady = times_ms[1:]
    return frames * len(steady) / (sum(steady) / 1000) if steady else math.nan


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


class DiffusersScenario:
    """The server's overhead over calling the same diffusers pipeline directly.

    Once: a worker process (``--diffusers-worker``) builds a random Wan pipeline of the
    preset's size into a temporary directory and loads it as the server does
    (``load_engine("diffusers", ...)``, ``threads=1``). Per run: a fresh server
    (``--engine diffusers``, the same engine args), one warm-up segment on each side, then
    ``diffusers_reps`` times, in alternating order: (a) the session's pipeline calls made
    directly in the worker, (b) the same session through the engine alone, in the worker,
    (c) the same session through the server, over a WebSocket.
    """

    def __init__(self, s: Settings, preset: DiffusersPreset, server_args: Sequence[str]) -> None:
        self.s = s
        self.preset = preset
        self.server_args = list(server_args)
        self.figures = Figures()
        self.checks: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.worker: DirectWorker | None = None
        self.target: Target | None = None
        self.inproc_torch_threads: int | None = None
        self.build_s: float | None = None
        self.worker_exit: int | None = None

    @property
    def segments(self) -> int:
        return self.s.diffusers_segments

    async def setup(self, work_dir: Path) -> None:
        preset = self.preset
        model = work_dir / f"Wan-random-{preset.name}"
        config = {"preset": preset.name, "model": str(model)}
        command = [
            sys.executable,
            str(BENCH_DIR / "run.py"),
            "--diffusers-worker",
            json.dumps(config),
        ]
        progress(f"diffusers: building and loading a random Wan pipeline ({preset.name} preset)")
        self.worker = DirectWorker(command, work_dir / "diffusers-worker.log")
        ready = await self.worker.start(timeout=600)
        self.build_s = ready["build_s"]
        self.inproc_torch_threads = ready["torch_threads"]
        spec = ["--engine", "diffusers", "--device", preset.device]
        for key, value in preset.engine_args(model).items():
            spec += ["--engine-arg", f"{key}={value}"]
        self.target = make_target(
            "diffusers", shlex.join([*spec, *self.server_args]), max_sessions_needed=1
        )

    async def close(self) -> None:
        if self.worker is not None:
            self.worker_exit = await self.worker.stop()
            self.worker = None

    async def _process_cost(
        self, run: int, side: str, pid: int | None, body: Callable[[], Awaitable[Any]]
    ) -> Any:
        """Run ``body``; record the process's page faults and CPU time per segment."""
        faults, cpu = minor_faults(pid), cpu_seconds(pid)
        result = await body()
        faults_after, cpu_after = minor_faults(pid), cpu_seconds(pid)
        if faults is not None and faults_after is not None:
            per_segment = (faults_after - faults) / self.segments
            self.figures.add(run, f"diffusers.{side}.faults_per_segment", [per_segment])
        if cpu is not None and cpu_after is not None:
            per_segment = (cpu_after - cpu) * 1000 / self.segments
            self.figures.add(run, f"diffusers.{side}.cpu_ms_per_segment", [per_segment])
        return result

    async def _direct(self, run: int, what: str, side: str, seed: int) -> list[float]:
        worker = self.worker
        assert worker is not None and worker.process is not None
        timeout = self.s.session_timeout_s

        async def call() -> dict[str, Any]:
            return await worker.call(timeout, what=what, segments=self.segments, seed=seed)

        result = await self._process_cost(run, side, worker.process.pid, call)
        return result["segment_ms"]

    async def _inproc(self, run: int, seed: int) -> None:
        times = await self._direct(run, "pipeline", "inproc", seed)
        self.figures.add(run, "diffusers.inproc.first_segment_ms", times[:1])
        self.figures.add(run, "diffusers.inproc.segment_ms", times[1:])
        self.figures.add(
            run, "diffusers.inproc.fps", [_steady_fps(times, self.preset.segment_frames)]
        )

    async def _engine(self, run: int, seed: int) -> None:
        times = await self._direct(run, "engine", "engine", seed)
        self.figures.add(run, "diffusers.engine.first_segment_ms", times[:1])
        self.figures.add(run, "diffusers.engine.segment_ms", times[1:])

    async def _streamed(self, run: int, seed: int, family: StreamedFamily) -> None:
        """First chunk vs whole call, for a streamed random pipeline (in the worker)."""
        worker = self.worker
        assert worker is not None
        result = await worker.call(
            self.s.session_timeout_s, what=family.key, segments=self.segments, seed=seed
        )
        if "error" in result:
            progress(f"  !! diffusers: {family.key}: {result['error']}")
            return
        whole, done = result["whole_call_ms"], result["chunk_done_ms"]
        prefix = f"diffusers.{family.key}"
        self.figures.add(run, f"{prefix}.whole_call_ms", [whole])
        self.figures.add(run, f"{prefix}.first_chunk_ms", done[:1])
        self.figures.add(run, f"{prefix}.streamed_total_ms", done[-1:])
        self.figures.add(run, f"{prefix}.first_chunk_fraction", [done[0] / whole])

    async def _server(self, ctx: RunContext, seed: int) -> None:
        frames = self.segments * self.preset.segment_frames
        client = SessionClient(
            ctx.endpoint,
            protocol.start_message(PROMPT, **self.preset.start_fields(frames, seed)),
        )
        await self._process_cost(
            ctx.run,
            "server",
            ctx.pid,
            functools.partial(
                run_clients, [client], trio.lowlevel.checkpoint, self.s.session_timeout_s
            ),
        )
        failed = report_failures([client], "diffusers: server session")
        await ctx.settle()
        if failed or not client.arrivals or client.t_start_sent is None:
            ctx.add("diffusers.server.errors", [1])
            return
        ctx.add("diffusers.server.errors", [0])
        arrivals = [t for t, _, _ in client.arrivals]
        ctx.add("diffusers.server.ttfc_ms", [(arrivals[0] - client.t_start_sent) * 1000])
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
        ctx.add("diffusers.server.interarrival_ms", gaps)
        if len(arrivals) > 1:
            steady = sum(f for _, f, _ in client.arrivals[1:])
            ctx.add("diffusers.server.fps", [steady / (arrivals[-1] - arrivals[0])])
        if len(client.arrivals) != self.segments:
            progress(f"  !! diffusers: {len(client.arrivals)} chunks for {self.segments} segments")

    async def run(self, run: int, log_dir: Path) -> None:
        assert self.target is not None and self.target.command is not None
        assert self.worker is not None
        s = self.s
        tag = f"run {run + 1}/{s.repeat} diffusers"
        server = ServerProcess(self.target.command, log_dir / f"server-diffusers-{run}.log")
        info: dict[str, Any] = {"run": run, "target": "diffusers"}
        try:
            url = await server.start(timeout=300)
            info["server_pid"] = server.pid
            progress(f"{tag}: server pid {server.pid} at {url}")
            endpoint = Endpoint.parse(url)
            ctx = RunContext(
                target=self.target,
                endpoint=endpoint,
                settings=s,
                figures=self.figures,
                run=run,
                pid=server.pid,
                rng=random.Random(s.seed * 1000 + run),
                checks=self.checks,
                has_metrics=await fetch_stats(endpoint) is not None,
            )
            progress(f"{tag}: warm-up, one segment on each side")
            warm_up = SessionClient(
                endpoint,
                protocol.start_message(
                    PROMPT, **self.preset.start_fields(self.preset.segment_frames, s.seed)
                ),
            )
            await run_clients([warm_up], trio.lowlevel.checkpoint, s.session_timeout_s)
            report_failures([warm_up], "diffusers: warm-up session")
            await ctx.settle()
            await self.worker.call(s.session_timeout_s, what="pipeline", segments=1, seed=s.seed)
            started = now()
            for rep in range(s.diffusers_reps):
                seed = s.seed + 1000 * (run * s.diffusers_reps + rep)
                steps = [
                    ("direct pipeline calls", functools.partial(self._inproc, run, seed)),
                    ("engine alone", functools.partial(self._engine, run, seed)),
                    ("server", functools.partial(self._server, ctx, seed)),
                ]
                if (run + rep) % 2:
                    steps.reverse()  # drift on the machine affects both sides alike
                for label, step in steps:
                    progress(f"{tag}: {label}, {self.segments} segments")
                    await step()
                for family in STREAMED:
                    progress(
                        f"{tag}: {family.label}, {self.segments} {family.unit}s, "
                        "streamed vs one call"
                    )
                    await self._streamed(run, seed, family)
            ctx.windows.append({"scenario": "diffusers", "start": started, "end": now()})
            info["windows"] = ctx.windows
            await ctx.check_after("diffusers")
            self._add_ratios(run)
        finally:
            info["server_exit"] = await server.stop()
            if info["server_exit"] != 0:
                progress(f"server exited with {info['server_exit']}:\n{server.log_tail(10)}")
            self.runs.append(info)

    def _run_median(self, name: str, run: int) -> float | None:
        figure = self.figures.get(name)
        if figure is None or len(figure.runs) <= run or not figure.runs[run]:
            return None
        return percentile(figure.runs[run], 50)

    def _add_ratios(self, run: int) -> None:
        """One value per run: the run's medians compared."""
        inproc = self._run_median("diffusers.inproc.segment_ms", run)
        server = self._run_median("diffusers.server.interarrival_ms", run)
        engine = self._run_median("diffusers.engine.segment_ms", run)
        if inproc and server:
            self.figures.add(run, "diffusers.overhead_pct", [100 * (server / inproc - 1)])
        if inproc and engine:
            self.figures.add(run, "diffusers.engine_overhead_pct", [100 * (engine / inproc - 1)])
        first = self._run_median("diffusers.inproc.first_segment_ms", run)
        ttfc = self._run_median("diffusers.server.ttfc_ms", run)
        if first and ttfc:
            self.figures.add(run, "diffusers.ttfc_overhead_ms", [ttfc - first])

    def evaluate(self) -> list[dict[str, Any]]:
        """Pooled medians of all runs: server per-segment time over the in-process one."""
        inproc = self.figures.stat("diffusers.inproc.segment_ms", "median")
        server = self.figures.stat("diffusers.server.interarrival_ms", "median")
        measured = None if not inproc or server is None else 100 * (server / inproc - 1)
        status = "N/A" if measured is None else "PASS"
        if measured is not None and measured > DIFFUSERS_OVERHEAD_LIMIT_PCT:
            status = "FAIL"
        leftovers = [c for c in self.checks if c["ok"] is False]
        cleanup = "PASS" if not leftovers else "FAIL"
        if not self.checks or any(c["ok"] is None for c in self.checks):
            cleanup = "N/A"
        return [
            {
                "target": "diffusers: server overhead per segment",
                "rule": "median chunk inter-arrival through the server / median segment time "
                "of the same pipeline calls made directly (in a process of their own) - 1 "
                "<= 5 %",
                "measured": measured,
                "threshold": DIFFUSERS_OVERHEAD_LIMIT_PCT,
                "status": status,
                "note": f"{server:.1f} ms vs {inproc:.1f} ms" if measured is not None else "",
            },
            *(self._streamed_verdict(family) for family in STREAMED),
            {
                "target": "diffusers: cleanup",
                "rule": "sessions_active = streams_open = worker_threads = 0 after each run",
                "measured": {"runs_with_leftovers": len(leftovers)},
                "threshold": None,
                "status": cleanup,
                "note": "",
            },
        ]

    def _streamed_verdict(self, family: StreamedFamily) -> dict[str, Any]:
        """The first chunk's share of the single call (pooled median) against 1.5 / k."""
        fraction = self.figures.stat(f"diffusers.{family.key}.first_chunk_fraction", "median")
        ideal = 1 / self.segments
        status = "N/A" if fraction is None else "PASS"
        if fraction is not None and fraction > CHUNKED_FIRST_CHUNK_SLACK * ideal:
            status = "FAIL"
        k, unit = self.segments, family.unit
        return {
            "target": family.target,
            "rule": f"a {family.label} streamed in {k} {unit}s: time to the first {unit} / "
            f"time of the single pipeline call for the whole video <= "
            f"{CHUNKED_FIRST_CHUNK_SLACK} / {k} (ideal 1/k, plus one decode)",
            "measured": fraction,
            "threshold": CHUNKED_FIRST_CHUNK_SLACK * ideal,
            "status": status,
            "note": "" if fraction is None else f"ideal {ideal:.3f}",
        }

    def to_json(self, verdicts: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.target is not None
        return {
            "preset": attrs.asdict(self.preset),
            "segments": self.segments,
            "reps_per_run": self.s.diffusers_reps,
            "build_s": self.build_s,
            "command": list(self.target.command or ()),
            "engine_args": dict(self.target.engine_args),
            "inproc_torch_threads": self.inproc_torch_threads,
            "worker_exit": self.worker_exit,
            **self.figures.to_json(),
            "checks": self.checks,
            "runs": self.runs,
            "targets": verdicts,
        }
