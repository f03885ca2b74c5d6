"""Pacing to media time (vllm-omni's ``extra_params.pace_to_media_time``): the server holds
each chunk until its media time less the lead; the engine never sees the parameters."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.conftest import Transcript, is_type, receive_into, receive_until
from trio_vstream import protocol
from trio_vstream.engines.synthetic import SyntheticSettings

START = {"type": "session.start", "prompt": "x", "size": "32x32", "fps": 8}


def test_pacing_parameters_are_validated_and_resolved() -> None:
    def start(**extra: Any) -> protocol.SessionStart:
        return protocol.parse_start(json.dumps({**START, "extra_params": extra}))

    assert start().pacing is None
    assert start(pacing_lead_seconds=1).pacing is None  # only pace_to_media_time turns it on
    assert start(pace_to_media_time=True).pacing == protocol.Pacing()
    assert start(
        pace_to_media_time=True, pacing_lead_seconds=0, pacing_max_lag_seconds=3.5
    ).pacing == protocol.Pacing(lead_seconds=0.0, max_lag_seconds=3.5)
    for extra, words in (
        ({"pace_to_media_time": "yes"}, "pace_to_media_time must be a boolean"),
        ({"pace_to_media_time": True, "pacing_lead_seconds": -1}, "pacing_lead_seconds"),
        ({"pace_to_media_time": True, "pacing_max_lag_seconds": True}, "pacing_max_lag"),
        ({"pace_to_media_time": True, "pacing_lead_seconds": "1"}, "pacing_lead_seconds"),
    ):
        with pytest.raises(protocol.ProtocolError) as caught:
            start(**extra)
        assert caught.value.code is protocol.ErrorCode.INVALID_REQUEST
        assert words in caught.value.message


@pytest.mark.slow
async def test_chunks_go_out_at_their_media_time_less_the_lead(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4))  # 0.5 s of video each
    lead = 0.1
    arrivals: list[float] = []
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(
            json.dumps(
                {
                    **START,
                    "num_frames": 16,
                    "extra_params": {"pace_to_media_time": True, "pacing_lead_seconds": lead},
                }
            )
        )
        for _ in range(4):
            await receive_until(ws, transcript, is_type("video.chunk_metadata"))
            arrivals.append(time.monotonic())
        await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done"
    # The server sends chunk k no earlier than its media time (0.5 s * k) less the lead,
    # from when it had chunk 0 (the media clock starts as chunk 0 is handed on, which is
    # after the engine made it). Measured from chunk 0's arrival instead, a slow first
    # encode or read under load could make a chunk on time look early.
    made = running.engine.streams[0].chunk_times[0]
    for index, arrived in enumerate(arrivals):
        assert arrived - made >= 0.5 * index - lead, (index, made, arrivals)
    # The engine never saw the server's parameters.
    assert running.engine.streams[0].request.extra_params == {}


async def test_a_stop_ends_a_paced_wait(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(
            json.dumps({**START, "num_frames": 800, "extra_params": {"pace_to_media_time": True}})
        )
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, transcript)
    assert transcript.terminal == [transcript.json[-1]]
    assert transcript.terminal[0]["type"] == "session.done"
    assert transcript.terminal[0]["stopped"] is True
    # 100 s of video: the stop did not wait for its media time.
    assert len(transcript.of_type("video.chunk_metadata")) <= 3
