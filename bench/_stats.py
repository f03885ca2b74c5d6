"""Statistics and figures: every measured quantity, by name, with its samples per run.

The catalogue names every figure the harness may report, with its unit and what it means,
so that a report explains itself and a misspelt figure fails at once rather than as a
silently missing row.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final

import attrs

CATALOGUE: Final[dict[str, tuple[str, str]]] = {
    "calib.engine_first_chunk_ms": (
        "ms",
        "engine alone (in the harness process): open_stream + first next_chunk",
    ),
    "calib.encode_first_chunk_ms": (
        "ms",
        "encoder alone: the first chunk (init segment + IDR) with a fresh encoder",
    ),
    "calib.encoder_open_ms": ("ms", "encoder alone: opening libx264"),
    "latency.connect_ms": ("ms", "TCP connect + WebSocket handshake"),
    "latency.video_start_ms": ("ms", "session.start sent -> video.start received"),
    "latency.ttfc_ms": ("ms", "session.start sent -> first media chunk received (TTFC)"),
    "latency.interarrival_ms": ("ms", "time between consecutive media chunks"),
    "latency.rtf": ("x", "real-time factor: media seconds per wall second, start -> last chunk"),
    "latency.transport_overhead_ms": (
        "ms",
        "median TTFC minus the engine's median time to its first chunk (one value per run)",
    ),
    "concurrency.n{N}.aggregate_fps": ("fps", "N sessions: frames/s delivered, all together"),
    "concurrency.n{N}.session_fps": ("fps", "N sessions: frames/s delivered to each session"),
    "concurrency.n{N}.fairness": ("ratio", "N sessions: slowest / fastest session's fps"),
    "concurrency.n{N}.ping_rtt_ms": ("ms", "N sessions: session.ping -> session.pong"),
    "concurrency.n{N}.pings_unanswered": ("count", "N sessions: pings without a pong"),
    "concurrency.n{N}.errors": ("count", "N sessions: sessions that failed"),
    "concurrency.n{N}.client_lag_ms": (
        "ms",
        "N sessions: the harness's own event loop waking late (10 ms sleeps)",
    ),
    "concurrency.n{N}.server_cpu_cores": ("cores", "N sessions: server process CPU use"),
    "concurrency.n{N}.client_cpu_cores": ("cores", "N sessions: harness process CPU use"),
    "abort.{P}.stop_done_ms": ("ms", "session.stop sent -> session.done received"),
    "abort.{P}.stop_not_done": ("count", "stops not answered by session.done (stopped)"),
    "abort.{P}.disconnect_closed_ms": (
        "ms",
        "client cuts TCP -> server's engine stream closed (stream_closed_at in /stats)",
    ),
    "abort.{P}.disconnect_ended_ms": ("ms", "client cuts TCP -> server's session handler ended"),
    "resources.rss_idle_connection_kib": ("KiB", "server RSS per idle WebSocket connection"),
    "resources.rss_streaming_session_mib": ("MiB", "server RSS per streaming session"),
    "resources.threads_alive_streaming": ("threads", "server threads_alive while streaming"),
    "resources.rss_retained_mib": (
        "MiB",
        "server RSS after the run (no session, threads back) minus RSS before it",
    ),
    "resources.threads_return_s": (
        "s",
        "after the last session: until threads_alive is back at its baseline",
    ),
    "encoder.{S}.ms_per_frame": ("ms", "FragmentedMP4Encoder.encode per frame"),
    "encoder.{S}.chunk_ms": ("ms", "encode of one chunk"),
    "encoder.{S}.first_chunk_ms": ("ms", "encode of the first chunk (init segment + IDR)"),
    "encoder.{S}.chunk_period_share_pct": ("%", "encode time / chunk period"),
    "diffusers.inproc.first_segment_ms": (
        "ms",
        "pipeline called directly: prompt encoding + first call + conversion to uint8",
    ),
    "diffusers.inproc.segment_ms": (
        "ms",
        "pipeline called directly: one segment's call + conversion (segments after the first)",
    ),
    "diffusers.inproc.fps": ("fps", "pipeline called directly: frames/s after the first segment"),
    "diffusers.engine.first_segment_ms": (
        "ms",
        "engine alone (no server): open_stream + first next_chunk",
    ),
    "diffusers.engine.segment_ms": (
        "ms",
        "engine alone (no server): next_chunk (segments after the first)",
    ),
    "diffusers.server.ttfc_ms": ("ms", "server: session.start sent -> first media chunk"),
    "diffusers.server.interarrival_ms": ("ms", "server: time between consecutive media chunks"),
    "diffusers.server.fps": ("fps", "server: frames/s delivered, first chunk -> last chunk"),
    "diffusers.server.errors": ("count", "server: sessions that failed"),
    "diffusers.{D}.faults_per_segment": (
        "count",
        "minor page faults of the whole process per segment, over a session (/proc/PID/stat)",
    ),
    "diffusers.{D}.cpu_ms_per_segment": (
        "ms",
        "CPU time of the whole process per segment, over a session (/proc/PID/stat)",
    ),
    "diffusers.overhead_pct": (
        "%",
        "per run: median server inter-arrival / median direct segment time - 1",
    ),
    "diffusers.engine_overhead_pct": (
        "%",
        "per run: median engine-alone segment time / median direct segment time - 1",
    ),
    "diffusers.ttfc_overhead_ms": (
        "ms",
        "per run: median server TTFC - median direct first segment",
    ),
    "batching.{M}.n{N}.ttfc_ms": (
        "ms",
        "batching on/off, N sessions started together: session.start -> first media chunk",
    ),
    "batching.{M}.n{N}.aggregate_fps": (
        "fps",
        "batching on/off, N sessions: frames/s delivered, all together (sum of the sessions' "
        "rates between their first and last chunk in the window)",
    ),
    "batching.{M}.n{N}.session_fps": ("fps", "batching on/off, N sessions: each session's fps"),
    "batching.{M}.n{N}.stop_done_ms": (
        "ms",
        "batching on/off, N sessions: session.stop sent -> session.done received",
    ),
    "batching.{M}.n{N}.batch_rows": (
        "count",
        "batching on/off, N sessions: rows the server ran in batches (/stats batch_rows)",
    ),
    "batching.{M}.n{N}.mean_batch": (
        "rows",
        "batching on/off, N sessions: rows per batched call (/stats batch_rows / batches)",
    ),
    "batching.{M}.n{N}.server_cpu_cores": ("cores", "batching on/off, N sessions: server CPU"),
    "batching.{M}.n{N}.errors": ("count", "batching on/off, N sessions: sessions that failed"),
    "batching.{M}.n{N}.ended_early": (
        "count",
        "batching on/off, N sessions: sessions whose video ended before the window did",
    ),
    "batching.n{N}.fps_ratio": (
        "x",
        "per run: aggregate fps batching on / off, N sessions",
    ),
    "batching.n{N}.ttfc_ratio": (
        "x",
        "per run: median TTFC batching on / off, N sessions",
    ),
    "effect.c{C}.n{N}.latency_ms": (
        "ms",
        "chunk_frames C, N sessions: camera interaction sent -> first chunk generated under "
        "it (started_event_ids) received",
    ),
    "effect.c{C}.n{N}.queued_ms": (
        "ms",
        "chunk_frames C, N sessions: session.interaction sent -> session.interaction.queued",
    ),
    "effect.c{C}.n{N}.aggregate_fps": (
        "fps",
        "chunk_frames C, N sessions: frames/s delivered, all together, while interacting",
    ),
    "effect.c{C}.n{N}.unresolved": (
        "count",
        "chunk_frames C, N sessions: interactions no chunk listed as started",
    ),
    "effect.c{C}.n{N}.errors": (
        "count",
        "chunk_frames C, N sessions: sessions that failed, interactions refused",
    ),
    "streaming.{M}.n{N}.ttfc_ms": (
        "ms",
        "paced/unpaced, N sessions: session.start sent -> first media chunk (time to first chunk)",
    ),
    "streaming.{M}.n{N}.ttff_ms": (
        "ms",
        "paced/unpaced, N sessions: session.start sent -> the simulated viewer's first frame "
        "(once its startup threshold of media is buffered)",
    ),
    "streaming.{M}.n{N}.interarrival_ms": (
        "ms",
        "paced/unpaced, N sessions: time between consecutive media chunks of a session",
    ),
    "streaming.{M}.n{N}.rtf": (
        "x",
        "paced/unpaced, N sessions: real-time factor, media seconds / (session.start -> "
        "last media chunk), per session",
    ),
    "streaming.{M}.n{N}.on_time_share": (
        "ratio",
        "paced/unpaced, N sessions: share of a session's chunks that arrived before the "
        "simulated viewer's playhead needed them",
    ),
    "streaming.{M}.n{N}.continuous_play_ratio": (
        "ratio",
        "paced/unpaced, N sessions: share of the viewer's wall time, first frame -> last, "
        "spent playing rather than stalled, per session",
    ),
    "streaming.{M}.n{N}.underruns": (
        "count",
        "paced/unpaced, N sessions: times a session's viewer ran out of media (stalls)",
    ),
    "streaming.{M}.n{N}.stall_ms": (
        "ms",
        "paced/unpaced, N sessions: a session's viewer's total time stalled",
    ),
    "streaming.{M}.n{N}.errors": ("count", "paced/unpaced, N sessions: sessions that failed"),
    "streaming.paused.{C}.active_fps": (
        "fps",
        "paused-sessions check: the active (unpaced) sessions' frames/s, all together; alone, "
        "beside paused sessions, or beside as many active ones",
    ),
    "streaming.paused.{C}.idle_fps": (
        "fps",
        "paused-sessions check: frames/s the other sessions received in the window (about "
        "0 when they are paused)",
    ),
    "streaming.paused.fps_ratio": (
        "x",
        "paused-sessions check: active fps beside paused sessions / alone, per repetition",
    ),
    "streaming.paused.errors": (
        "count",
        "paused-sessions check: sessions that failed (a paused one refused, or ended)",
    ),
    "glass.page_key_to_frame_ms": (
        "ms",
        "the page's Key to frame: key press -> first presented frame at the media time "
        "where the chunk that started it begins",
    ),
    "glass.pixel_key_to_frame_ms": (
        "ms",
        "key press -> first presented frame whose motion turned the key's way (pixels only)",
    ),
    "glass.missed_turns": ("count", "per run: presses whose turn no presented frame showed"),
    "glass.presented_frames": ("count", "per run: frames the video element presented"),
    "glass.play_ratio": (
        "ratio",
        "per run: share of the presses' span the video played (from presented frames)",
    ),
    "glass.chunk_margin_ms": (
        "ms",
        "a media chunk's arrival on the page -> its first frame presented (its slack)",
    ),
    "glass.key_to_arrival_ms": (
        "ms",
        "key press -> arrival of the chunk that started its camera (window wait, "
        "generation, encode, transport)",
    ),
    "glass.arrival_to_frame_ms": (
        "ms",
        "that chunk's arrival -> the first presented frame showing it (the player's lag)",
    ),
    "glass.chunk_interarrival_ms": ("ms", "between two media chunks' arrivals on the page"),
    "glass.delivery_rtf": (
        "x",
        "per run: media seconds arrived per wall second, first to last chunk (paced: 1)",
    ),
    "glass.engine_chunk_ms": (
        "ms",
        "per run: the engine's mean time per chunk (the server's /metrics), the floor "
        "under the playhead's lag",
    ),
    "glass.underruns": ("count", "per run: the page's underruns (waiting after playing)"),
    "glass.stall_ms": ("ms", "per run: the page's time waiting after playback began"),
    "camera_in.camera_to_frame_ms": (
        "ms",
        "the page's Camera to frame: the input frame a chunk's last output frame was made "
        "from drawn -> that output frame presented",
    ),
    "camera_in.drawn_to_arrival_ms": (
        "ms",
        "that input frame drawn -> its chunk's metadata on the page (JPEG, upload, decode, "
        "generation, encode, transport)",
    ),
    "camera_in.arrival_to_frame_ms": (
        "ms",
        "the chunk's metadata on the page -> its last frame presented (the player's lag "
        "and the buffer)",
    ),
    "camera_in.buffer_ms": (
        "ms",
        "(chunk frames - 1) / fps per chunk, from the chunks' metadata: the capture time "
        "a chunk's window spans",
    ),
    "camera_in.player_lag_ms": (
        "ms",
        "a media chunk's arrival on the page -> its first frame presented",
    ),
    "camera_in.chunk_interarrival_ms": ("ms", "between two media chunks' arrivals on the page"),
    "camera_in.engine_chunk_ms": (
        "ms",
        "per run: the engine's mean time per chunk over the measured span (/metrics)",
    ),
    "camera_in.encode_ms": (
        "ms",
        "per run: the encoder's mean time per chunk over the measured span (/metrics)",
    ),
    "camera_in.engine_queue_wait_ms": (
        "ms",
        "per run: the mean wait for the engine per chunk over the measured span (/metrics)",
    ),
    "camera_in.encode_queue_wait_ms": (
        "ms",
        "per run: the mean wait for an encode slot per chunk over the measured span (/metrics)",
    ),
    "camera_in.inputs_sent": ("count", "per run: input frames the page sent, warm-up included"),
    "camera_in.inputs_skipped": (
        "count",
        "per run: captures the page did not send (ahead of the engine, or still encoding)",
    ),
    "camera_in.inputs_dropped": (
        "count",
        "per run: input frames the server dropped (its buffer full), over the measured span",
    ),
    "camera_in.capture_fps": (
        "fps",
        "per run: the page's captures (sent or skipped) a second over the measured span; "
        "the session's fps, or the server's input waits for good",
    ),
    "camera_in.presented": ("count", "per run: frames the video element presented"),
    "camera_in.underruns": ("count", "per run: the page's underruns (waiting after playing)"),
    "camera_in.stall_ms": ("ms", "per run: the page's time waiting after playback began"),
    "overhead.server_ms_per_frame": (
        "ms",
        "per run: the server process's CPU (all threads) per frame delivered, the "
        "engine's frame generation included",
    ),
    "overhead.engine_ms_per_frame": (
        "ms",
        "per run: its engine's next_chunk calls' thread CPU per frame (/stats "
        "engine_cpu_seconds): the synthetic engine rendering its frames",
    ),
    "overhead.serving_ms_per_frame": (
        "ms",
        "per run: server minus engine, per frame: decoding nothing, encoding, muxing, "
        "sending, the event loop and its threads",
    ),
    "overhead.bare_ms_per_frame": (
        "ms",
        "per run: a bare PyAV/libx264 encoder's CPU (all threads) per frame, same "
        "settings, conversion and frames, their generation left out",
    ),
    "overhead.bare_generate_ms_per_frame": (
        "ms",
        "per run: the bare side's generation of those frames (the engine's, in its process)",
    ),
    "overhead.ratio": ("ratio", "per run: serving / bare, CPU per frame (the target's figure)"),
    "overhead.ratio_with_generation": (
        "ratio",
        "per run: server / (bare + its generation): both with their frames' making",
    ),
    "overhead.aggregate_fps": (
        "fps",
        "per run: frames delivered over the sessions' wall time (a shared machine: indicative)",
    ),
    "overhead.errors": ("count", "per run: failed sessions, or frames missing"),
    # The fleet scenario (bench.scenarios.fleet): F is `one` (one server behind nginx) or
    # `three` (three servers behind nginx, each relaying viewers of the others' sessions).
    "fleet.{F}.sessions_completed": (
        "count",
        "per run: sessions of the wave that got their whole video and session.done",
    ),
    "fleet.{F}.sessions_refused": (
        "count",
        "per run: sessions refused with server_busy (an error before video.start, or 503)",
    ),
    "fleet.{F}.sessions_failed": ("count", "per run: sessions neither completed nor refused"),
    "fleet.{F}.viewers_complete": (
        "count",
        "per run: viewers that got every chunk from where they joined, and the session's end",
    ),
    "fleet.{F}.viewers_failed": ("count", "per run: viewers opened that did not"),
    "fleet.{F}.viewers_relayed": (
        "count",
        "per run: viewers nginx sent to a server other than the session's (nginx's log)",
    ),
    "fleet.{F}.relayed_delay_ms": (
        "ms",
        "a relayed viewer's media chunk: received by the viewer - received by the owner",
    ),
    "fleet.{F}.direct_delay_ms": (
        "ms",
        "a direct viewer's media chunk: received by the viewer - received by the owner",
    ),
    "fleet.{F}.relayed_delay_p50_ms": ("ms", "per run: the relayed viewers' delay, median"),
    "fleet.{F}.relayed_delay_p95_ms": ("ms", "per run: the relayed viewers' delay, p95"),
    "fleet.{F}.direct_delay_p50_ms": ("ms", "per run: the direct viewers' delay, median"),
    "fleet.{F}.direct_delay_p95_ms": ("ms", "per run: the direct viewers' delay, p95"),
    "fleet.{F}.ttfc_ms": ("ms", "a completed session: session.start sent -> first media chunk"),
    "fleet.{F}.wave_s": ("s", "per run: the wave's first session opened -> its last client done"),
    # The hls scenario (bench.scenarios.hls): S is `alone` (nobody watches) or `crowd`
    # (hls_viewers LL-HLS viewers through nginx's cache).
    "hls.{S}.cpu_ms_per_frame": (
        "ms",
        "per run: the server process's CPU (user + system) from the session's start to its "
        "last client done, per frame the owner got",
    ),
    "hls.{S}.session_s": ("s", "per run: the session's start -> its last client done"),
    "hls.cpu_ratio": ("ratio", "per run: crowd / alone, the server's CPU per frame"),
    "hls.viewers_complete": (
        "count",
        "per run: viewers that got every part, in order, and the owner's bytes exactly",
    ),
    "hls.viewers_failed": ("count", "per run: viewers that did not"),
    "hls.origin_per_part": (
        "count",
        "a part: its requests that reached the server (nginx's log: upstream not -)",
    ),
    "hls.origin_per_part_median": ("count", "per run: requests per part to the server, median"),
    "hls.origin_per_part_max": ("count", "per run: requests per part to the server, max"),
    "hls.origin_per_reload_max": (
        "count",
        "per run: requests for one blocking reload's query that reached the server, max",
    ),
    "hls.origin_requests": (
        "count",
        "per run: the crowd's requests that reached the server (first loads included)",
    ),
    "hls.viewer_requests": ("count", "per run: the crowd's requests to nginx"),
    "hls.cache_hit_pct": ("%", "per run: the crowd's requests nginx's cache answered (HIT)"),
    "hls.part_delay_ms": (
        "ms",
        "a part: received by a viewer - its chunk received by the owner",
    ),
    "hls.part_delay_p50_ms": ("ms", "per run: a part's delay behind the owner, median"),
    "hls.part_delay_p95_ms": ("ms", "per run: a part's delay behind the owner, p95"),
    # The hls_latency scenario (bench.scenarios.hls_latency): hls.js through nginx; V is
    # the viewer, `first` (given the URL at video.start) or `joined` (later).
    "hls_latency.{V}.chunk_delay_ms": (
        "ms",
        "a media chunk: the owner's receipt on the WebSocket -> its first frame presented "
        "by hls.js (LL-HLS through nginx)",
    ),
    "hls_latency.{V}.delay_p50_ms": ("ms", "per run: the chunks' delay, median"),
    "hls_latency.{V}.delay_p95_ms": ("ms", "per run: the chunks' delay, p95"),
    "hls_latency.{V}.chunks_presented": (
        "count",
        "per run: chunks whose first frame hls.js presented (those after it joined)",
    ),
    "hls_latency.{V}.chunks_missed": (
        "count",
        "per run: chunks after the first presented whose first frame never showed",
    ),
    "hls_latency.{V}.hlsjs_latency_ms": (
        "ms",
        "hls.js's own estimate of its distance behind the live edge, every 250 ms",
    ),
    "hls_latency.{V}.hlsjs_target_ms": ("ms", "the distance behind the live edge hls.js aims at"),
    "hls_latency.{V}.stalls": ("count", "per run: hls.js's bufferStalledError events"),
    "hls_latency.engine_chunk_ms": (
        "ms",
        "per run: the engine's mean time per chunk (the server's /metrics)",
    ),
}

CATALOGUE.update(
    {
        # The decode scenario is the batching one with other modes (bench.scenarios.decode).
        "decode." + key.removeprefix("batching."): (
            unit,
            text.replace("batching on/off", "decode deferred/eager").replace(
                "batching on / off", "decode deferred / eager"
            ),
        )
        for key, (unit, text) in list(CATALOGUE.items())
        if key.startswith("batching.")
    }
)


def catalogue_key(name: str) -> str:
    """``concurrency.n8.ping_rtt_ms`` -> ``concurrency.n{N}.ping_rtt_ms``, and so on."""
    name = re.sub(r"^concurrency\.n\d+\.", "concurrency.n{N}.", name)
    name = re.sub(r"^batching\.(on|off)\.n\d+\.", "batching.{M}.n{N}.", name)
    name = re.sub(r"^batching\.n\d+\.", "batching.n{N}.", name)
    name = re.sub(r"^decode\.(deferred|eager)\.n\d+\.", "decode.{M}.n{N}.", name)
    name = re.sub(r"^decode\.n\d+\.", "decode.n{N}.", name)
    name = re.sub(r"^effect\.c\d+\.n\d+\.", "effect.c{C}.n{N}.", name)
    name = re.sub(r"^streaming\.(paced|unpaced)\.n\d+\.", "streaming.{M}.n{N}.", name)
    name = re.sub(r"^streaming\.paused\.(alone|paused|active)\.", "streaming.paused.{C}.", name)
    name = re.sub(r"^fleet\.(one|three)\.", "fleet.{F}.", name)
    name = re.sub(r"^hls\.(alone|crowd)\.", "hls.{S}.", name)
    name = re.sub(r"^hls_latency\.(first|joined)\.", "hls_latency.{V}.", name)
    name = re.sub(r"^abort\.(idle|load)\.", "abort.{P}.", name)
    name = re.sub(r"^diffusers\.(inproc|engine|server)\.(faults|cpu)_", r"diffusers.{D}.\2_", name)
    return re.sub(r"^encoder\.\d+x\d+\.", "encoder.{S}.", name)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """n, min, median, p99 and max of the finite values: a failed sample (NaN) is left
    out rather than poisoning the figure; all ``None`` where there is none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"n": 0, "min": None, "median": None, "p99": None, "max": None}
    return {
        "n": len(finite),
        "min": min(finite),
        "median": percentile(finite, 50),
        "p99": percentile(finite, 99),
        "max": max(finite),
    }


@attrs.define
class Figure:
    """One measured quantity: its samples, kept per run so that the spread can be shown."""

    name: str
    runs: list[list[float]] = attrs.field(factory=list)

    @property
    def unit(self) -> str:
        return CATALOGUE[catalogue_key(self.name)][0]

    @property
    def description(self) -> str:
        return CATALOGUE[catalogue_key(self.name)][1]

    @property
    def pooled(self) -> list[float]:
        return [v for run in self.runs for v in run]

    def to_json(self) -> dict[str, Any]:
        runs = [{**summarize(vs), "values": [round(v, 4) for v in vs]} for vs in self.runs]
        return {
            "unit": self.unit,
            "description": self.description,
            **summarize(self.pooled),
            "run_medians": [r["median"] for r in runs],
            "runs": runs,
        }


class Figures:
    """Every figure of one target (or of the local, server-less measurements)."""

    def __init__(self) -> None:
        self._figures: dict[str, Figure] = {}
        self._unavailable: dict[str, str] = {}

    def add(self, run: int, name: str, values: Iterable[float]) -> None:
        if catalogue_key(name) not in CATALOGUE:
            raise KeyError(f"figure {name!r} is not in the catalogue")
        figure = self._figures.setdefault(name, Figure(name))
        while len(figure.runs) <= run:
            figure.runs.append([])
        figure.runs[run].extend(float(v) for v in values)

    def mark_unavailable(self, name: str, reason: str) -> None:
        self._unavailable.setdefault(name, reason)

    @property
    def unavailable(self) -> dict[str, str]:
        return {k: v for k, v in self._unavailable.items() if k not in self._figures}

    def get(self, name: str) -> Figure | None:
        return self._figures.get(name)

    def stat(self, name: str, key: str) -> float | None:
        figure = self._figures.get(name)
        return None if figure is None else summarize(figure.pooled)[key]

    def __iter__(self) -> Iterator[Figure]:
        return iter(self._figures.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "figures": {name: fig.to_json() for name, fig in self._figures.items()},
            "unavailable": self.unavailable,
        }
