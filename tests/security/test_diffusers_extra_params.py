"""Attack: ``extra_params`` reach a diffusers pipeline's call (issue 20, item 9).

They were filtered by a deny-list (the arguments the engine sets itself), so anything
else the call (or the loop the engine drives) takes went through unchecked: a
``max_sequence_length`` of a million tokens, a million-step ``sigmas`` schedule, a
pyramid of a million steps a stage, a FramePack section of ten thousand latent frames.
Now each family of pipeline takes an allow-list of keys, each checked for type and
bounds before the stream opens; anything else is ``invalid_request``, naming the key and
what the pipeline takes. The tiny pipelines of ``tests/engines/diffusers`` stand in for
the real ones: every refusal here happens before the pipeline runs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.engines.diffusers.conftest import (  # noqa: F401 (fixtures)
    anyflow_far,
    framepack,
    helios,
    make_engine,
    models,
    serve,
    skyreels,
)
from tests.engines.diffusers.support import START, no_stop, request, run_session
from trio_vstream.engines import InvalidRequestError

MILLION = 10**6


def refusal(engine: Any, **fields: Any) -> str:
    """The ``invalid_request`` text ``open_stream`` refuses these request fields with."""
    with pytest.raises(InvalidRequestError) as refused:
        engine.open_stream(request(**fields))
    return str(refused.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Padding every prompt to a million tokens: the text encoder's time and memory.
        ({"max_sequence_length": MILLION}, "max_sequence_length must be an integer from 1 to 512"),
        ({"max_sequence_length": 0}, "max_sequence_length must be an integer from 1 to 512"),
        ({"max_sequence_length": "64"}, "max_sequence_length must be an integer"),
        ({"max_sequence_length": True}, "max_sequence_length must be an integer"),
        # The LoRA layers of the shared pipeline are multiplied by this, then divided.
        ({"attention_kwargs": {"scale": 1e308}}, "attention_kwargs.scale must be a number"),
        ({"attention_kwargs": {"scale": float("nan")}}, "attention_kwargs.scale must be a num"),
        ({"attention_kwargs": {"processor": "x"}}, "attention_kwargs takes only scale"),
        ({"attention_kwargs": [1]}, "attention_kwargs takes only scale"),
        # What the engine sets itself is refused with what to use instead.
        ({"num_videos_per_prompt": 64}, "extra_params set by the engine: num_videos_per_prompt"),
        ({"latents": [0.0]}, "extra_params set by the engine: latents"),
        # Not in Wan's list (nor its call): named, with what it takes.
        (
            {"sigmas": [0.5]},
            r"unknown extra_params for WanPipeline: sigmas \(a pipeline served segment by "
            r"segment takes attention_kwargs, max_sequence_length\)",
        ),
    ],
)
def test_wan_refuses_keys_and_values_outside_its_allow_list(
    models: SimpleNamespace,  # noqa: F811
    make_engine: Any,  # noqa: F811
    extra: dict[str, Any],
    message: str,
) -> None:
    engine = make_engine(models.t2v)
    with pytest.raises(InvalidRequestError, match=message):
        engine.open_stream(request(extra_params=extra))


def test_a_refused_key_is_shown_escaped_and_the_list_bounded(
    models: SimpleNamespace,  # noqa: F811
    make_engine: Any,  # noqa: F811
) -> None:
    engine = make_engine(models.t2v)
    extra = {"x\ny": 1, "k" * 10_000: 1, **{f"knob{i:02}": i for i in range(20)}}
    message = refusal(engine, extra_params=extra)
    assert "\n" not in message and "'x\\ny'" in message
    assert "k" * 100 not in message  # a long name is cut short
    assert "and 12 more" in message and len(message) < 1000


def test_legal_values_still_reach_the_call(
    models: SimpleNamespace,  # noqa: F811
    make_engine: Any,  # noqa: F811
) -> None:
    engine = make_engine(models.t2v)
    pipe = engine.model.pipe
    seen: list[dict[str, Any]] = []
    call = type(pipe).__call__

    def spy(self: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return call(self, **kwargs)

    extra = {"max_sequence_length": 64, "attention_kwargs": {"scale": 0.5}}
    stream = engine.open_stream(request(num_frames=5, extra_params=extra))
    type(pipe).__call__ = spy
    try:
        assert stream.next_chunk(no_stop) is not None
    finally:
        type(pipe).__call__ = call
        stream.close()
    assert seen[0]["max_sequence_length"] == 64
    assert seen[0]["attention_kwargs"] == {"scale": 0.5}


async def test_the_client_hears_invalid_request_and_server_keys_still_work(
    models: SimpleNamespace,  # noqa: F811
    make_engine: Any,  # noqa: F811
    serve: Any,  # noqa: F811
) -> None:
    """Through the server: a bad key is named in ``invalid_request``; the keys the server
    applies itself (pacing here) never reach the engine's allow-list."""
    server, _ = await serve(make_engine(models.t2v))
    transcript = await run_session(
        server.url, {**START, "extra_params": {"max_sequence_length": MILLION, "bogus": 1}}
    )
    [error] = transcript.terminal
    assert error["type"] == "error" and error["code"] == "invalid_request"
    assert "max_sequence_length must be an integer from 1 to 512" in error["message"]
    assert "unknown extra_params for WanPipeline: bogus" in error["message"]
    paced = {**START, "num_frames": 5, "extra_params": {"pace_to_media_time": True}}
    transcript = await run_session(server.url, paced)
    assert transcript.terminal[-1]["type"] == "session.done"


def test_helios_refuses_steps_and_schedules_out_of_bounds(
    helios: dict[str, Path],  # noqa: F811
    make_engine: Any,  # noqa: F811
) -> None:
    fields = {"width": 64, "height": 64}
    pyramid = make_engine(helios["pyramid"], segment_frames="33")
    # A million steps a pyramid stage: each stage's count is bounded like num_inference_steps.
    message = refusal(
        pyramid, **fields, extra_params={"pyramid_num_inference_steps_list": [MILLION] * 3}
    )
    assert "pyramid_num_inference_steps_list must be a list of 3 integers from 1 to 200" in message
    assert "zero_steps must be an integer from 0 to 200" in refusal(
        pyramid, **fields, extra_params={"zero_steps": MILLION}
    )
    base = make_engine(helios["base"], segment_frames="33")
    # One transformer pass per entry: a schedule is no longer than the step cap...
    assert "sigmas must be a list of 1 to 200 numbers from 0 to 1" in refusal(
        base, **fields, num_inference_steps=None, extra_params={"sigmas": [0.5] * MILLION}
    )
    assert "sigmas must be a list" in refusal(base, **fields, extra_params={"sigmas": [2.0]})
    assert "sigmas must be a list" in refusal(base, **fields, extra_params={"sigmas": "0.5"})
    # ... and agrees with num_inference_steps when both are given.
    assert "sigmas has 3 entries, one per step, but num_inference_steps is 2" in refusal(
        base, **fields, num_inference_steps=2, extra_params={"sigmas": [0.9, 0.5, 0.1]}
    )


def test_anyflow_far_refuses_schedules_out_of_bounds(
    anyflow_far: Path,  # noqa: F811
    make_engine: Any,  # noqa: F811
) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    fields = {"width": 32, "height": 32, "num_frames": 25, "num_inference_steps": None}
    assert "timesteps must be a list of 1 to 200 numbers from 0 to 1000" in refusal(
        engine, **fields, extra_params={"timesteps": [5000.0]}
    )
    assert "sigmas must be a list of 1 to 200" in refusal(
        engine, **fields, extra_params={"sigmas": [0.5] * 201}
    )
    assert "give sigmas or timesteps, not both" in refusal(
        engine, **fields, extra_params={"sigmas": [0.5], "timesteps": [500.0]}
    )
    assert "chunk_partition must be a list of positive integers" in refusal(
        engine, **fields, extra_params={"chunk_partition": "x" * MILLION}
    )


def test_framepack_refuses_sections_and_schedules_out_of_bounds(
    framepack: Path,  # noqa: F811
    make_engine: Any,  # noqa: F811
) -> None:
    engine = make_engine(framepack, segment_frames="12")
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    fields = {"width": 32, "height": 32, "num_frames": 27, "image": image}
    for sampling in ("vanilla", "inverted_anti_drifting"):
        # Ten thousand latent frames in one section, whatever num_frames.
        extra = {"sampling_type": sampling, "latent_window_size": 10_000}
        assert "latent_window_size must be an integer from 1 to 7" in refusal(
            engine, **fields, extra_params=extra
        )
        # A section's steps are the schedule's entries.
        extra = {"sampling_type": sampling, "sigmas": [0.5] * MILLION}
        assert "sigmas must be a list of 1 to 200" in refusal(
            engine, **fields, num_inference_steps=None, extra_params=extra
        )


def test_skyreels_df_refuses_a_lag_beyond_any_schedule(
    skyreels: dict[str, Path],  # noqa: F811
    make_engine: Any,  # noqa: F811
) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames="17")
    fields = {"width": 32, "height": 32, "num_frames": 41}
    assert "ar_step must be an integer from 0 to 200" in refusal(
        engine, **fields, extra_params={"ar_step": MILLION}
    )
    assert "addnoise_condition must be in 0..1000" in refusal(
        engine, **fields, extra_params={"addnoise_condition": float("inf")}
    )
