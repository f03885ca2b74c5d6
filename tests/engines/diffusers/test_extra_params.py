"""``extra_params`` allow-lists (``trio_vstream.engines.diffusers._extra``, each family's
in its module of ``loops``), on stand-in pipelines: each family's keys, the checks and
their bounds, and the messages.

(What a real pipeline refuses and takes: ``tests/security/test_diffusers_extra_params.py``,
and each family's own tests.)
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import attrs
import numpy as np
import pytest

from trio_vstream.engines.diffusers._extra import (
    COMMON,
    MAX_STEPS,
    by_plan,
    check_extra_params,
    schedule_steps,
)
from trio_vstream.engines.diffusers._extra import ExtraParams as Family
from trio_vstream.engines.diffusers._loading import PipelineInfo
from trio_vstream.engines.diffusers.loops.far import EXTRA_PARAMS as ANYFLOW_FAR
from trio_vstream.engines.diffusers.loops.forcing import EXTRA_PARAMS as SKYREELS_DF
from trio_vstream.engines.diffusers.loops.forcing import FORCING_ARGS
from trio_vstream.engines.diffusers.loops.framepack import EXTRA_PARAMS as FRAMEPACK
from trio_vstream.engines.diffusers.loops.history import HELIOS, HELIOS_PYRAMID
from trio_vstream.engines.diffusers.loops.segments import EXTRA_PARAMS as SEGMENTS
from trio_vstream.protocol import VideoRequest
from trio_vstream.protocol._wire import CHECKS

FAMILIES = (SEGMENTS, HELIOS, HELIOS_PYRAMID, SKYREELS_DF, ANYFLOW_FAR, FRAMEPACK)


def stub(call: Any, *, name: str = "StubPipeline", train_timesteps: int = 1000) -> PipelineInfo:
    """A stand-in pipeline whose ``__call__`` has ``call``'s signature."""
    params = dict(inspect.signature(call).parameters)
    scheduler = SimpleNamespace(config={"num_train_timesteps": train_timesteps})
    return PipelineInfo(
        pipe=SimpleNamespace(scheduler=scheduler),
        role="model",
        class_name=name,
        params=params,
        var_kwargs=False,
        takes_image=False,
        needs_image=False,
        size_multiple=16,
        frame_step=4,
        encode_params=None,
    )


def takes_all(
    prompt: str = "",
    num_inference_steps: int = 50,
    sigmas: Any = None,
    timesteps: Any = None,
    attention_kwargs: Any = None,
    max_sequence_length: int = 512,
    zero_steps: int = 1,
    use_zero_init: bool = True,
    is_amplify_first_chunk: bool = False,
    latents: Any = None,
) -> None:
    """A call that takes every checked key (and ``latents``, which the engine sets)."""


def check(
    extra: dict[str, Any],
    family: Family = HELIOS,
    *,
    used: list[PipelineInfo] | None = None,
    steps: int | None = None,
) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    checked = check_extra_params(
        extra,
        family=family,
        used=used or [stub(takes_all)],
        engine_set={"latents": ""},
        steps=steps,
        problems=problems,
    )
    return checked, problems


def test_every_key_of_every_family_has_a_check_or_a_loop_plan() -> None:
    for family in FAMILIES:
        assert set(COMMON) <= set(family.keys)
        for key, check in family.checks.items():
            if check is not by_plan:
                # Refused by its check, never unchecked.
                with pytest.raises(ValueError, match=rf"^extra_params\.{key} "):
                    check(key, object(), [stub(takes_all)])


def test_the_step_cap_is_the_protocols() -> None:
    assert attrs.fields(VideoRequest).num_inference_steps.metadata[CHECKS].le == MAX_STEPS


def test_skyreels_keys_are_the_window_loops() -> None:
    assert sorted(set(SKYREELS_DF.keys) - set(COMMON)) == sorted(FORCING_ARGS)


def test_a_key_the_call_does_not_take_is_refused_even_if_the_family_lists_it() -> None:
    def no_schedules(prompt: str = "", max_sequence_length: int = 512) -> None: ...

    _, problems = check({"sigmas": [0.5]}, used=[stub(no_schedules, name="Plain")])
    assert problems == [
        "unknown extra_params for Plain: sigmas "
        "(Helios takes is_enable_stage2, max_sequence_length, use_cfg_zero_star)"
    ]


def test_engine_set_keys_get_a_hint_and_unknown_ones_the_list() -> None:
    _, problems = check({"latents": 1, "bogus": 2, "generator": 3})
    assert problems == [
        "extra_params set by the engine: latents",
        "unknown extra_params for StubPipeline: bogus, generator "
        "(Helios takes attention_kwargs, is_enable_stage2, max_sequence_length, sigmas, "
        "use_cfg_zero_star)",
    ]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"max_sequence_length": 1}, {"max_sequence_length": 1}),
        ({"max_sequence_length": 512}, {"max_sequence_length": 512}),
        ({"attention_kwargs": {}}, {"attention_kwargs": {}}),
        ({"attention_kwargs": {"scale": -4}}, {"attention_kwargs": {"scale": -4}}),
        ({"sigmas": [1, 0.5, 0]}, {"sigmas": np.array([1.0, 0.5, 0.0])}),
    ],
)
def test_values_within_bounds_are_taken(extra: dict[str, Any], expected: dict[str, Any]) -> None:
    checked, problems = check(extra)
    assert problems == []
    assert checked.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(checked[key], value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_sequence_length": 513}, "max_sequence_length must be an integer from 1 to 512"),
        ({"max_sequence_length": 10**400}, "from 1 to 512, got 1000000"),
        ({"max_sequence_length": 64.0}, "max_sequence_length must be an integer"),
        ({"attention_kwargs": {"scale": 4.5}}, "attention_kwargs.scale must be a number from -4"),
        ({"attention_kwargs": {"scale": "1"}}, "attention_kwargs.scale must be a number"),
        ({"attention_kwargs": {"scale": True}}, "attention_kwargs.scale must be a number"),
        ({"attention_kwargs": {"scale": 1, "x": 2}}, "attention_kwargs takes only scale"),
        ({"sigmas": []}, "sigmas must be a list of 1 to 200 numbers from 0 to 1"),
        ({"sigmas": [0.5] * (MAX_STEPS + 1)}, "sigmas must be a list of 1 to 200"),
        ({"sigmas": [float("nan")]}, "sigmas must be a list"),
        ({"sigmas": [float("inf")]}, "sigmas must be a list"),
        ({"sigmas": [-0.1]}, "sigmas must be a list"),
        ({"sigmas": [True]}, "sigmas must be a list"),
        ({"sigmas": {"0": 0.5}}, "sigmas must be a list"),
        ({"sigmas": [10**400]}, "sigmas must be a list"),
    ],
)
def test_values_out_of_type_or_bounds_are_refused(extra: dict[str, Any], message: str) -> None:
    checked, problems = check(extra)
    assert checked == {}
    assert len(problems) == 1 and message in problems[0]
    assert len(problems[0]) < 300  # whatever was sent, the message stays short


def test_max_sequence_length_is_capped_by_the_pipelines_own_default() -> None:
    def short(prompt: str = "", max_sequence_length: int = 226) -> None: ...

    used = [stub(takes_all), stub(short)]  # the first segment's and the following ones'
    _, problems = check({"max_sequence_length": 300}, SEGMENTS, used=used)
    assert problems == [
        "extra_params.max_sequence_length must be an integer from 1 to 226, got 300"
    ]


def test_timesteps_are_in_the_schedulers_units() -> None:
    used = [stub(takes_all, train_timesteps=100)]
    assert check({"timesteps": [100, 50]}, ANYFLOW_FAR, used=used)[1] == []
    _, problems = check({"timesteps": [1000]}, ANYFLOW_FAR, used=used)
    assert "timesteps must be a list of 1 to 200 numbers from 0 to 100" in problems[0]


def test_a_schedule_agrees_with_the_steps_and_sets_them() -> None:
    checked, problems = check({"sigmas": [0.9, 0.5]}, ANYFLOW_FAR, steps=2)
    assert problems == [] and schedule_steps(checked) == 2
    assert checked["sigmas"] == (0.9, 0.5)  # a tuple, not an array: FAR takes a list
    _, problems = check({"sigmas": [0.9, 0.5]}, ANYFLOW_FAR, steps=3)
    assert problems == [
        "extra_params.sigmas has 2 entries, one per step, but num_inference_steps is 3"
    ]
    _, problems = check({"sigmas": [0.5], "timesteps": [500]}, ANYFLOW_FAR)
    assert problems == ["extra_params: give sigmas or timesteps, not both"]
    assert schedule_steps({}) is None


def test_loop_keys_are_left_to_the_loops_plan() -> None:
    checked, problems = check({"chunk_partition": "anything"}, ANYFLOW_FAR, used=[stub(far_call)])
    assert problems == [] and checked == {"chunk_partition": "anything"}


def far_call(prompt: str = "", chunk_partition: Any = None) -> None: ...
