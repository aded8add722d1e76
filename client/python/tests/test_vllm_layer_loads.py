"""kvq.vllm's layer-by-layer loads (LayerLoads, what the connector's wait_for_layer_load waits
on): a layer is released as soon as every load of the step has written it, while later layers
are still loading; a failed load releases the layers it never wrote; a waiter that gives up
cancels the step, after which no write starts and none is in progress. Needs no vLLM."""

from __future__ import annotations

import threading
import time

import pytest

from kvq.vllm.layer_loads import LayerLoads, StepCancelled

LAYERS = 4


def test_a_layer_is_released_while_later_layers_still_load():
    go_on = [threading.Event() for _ in range(LAYERS)]
    written = []

    def job(step: LayerLoads) -> None:
        for layer in range(LAYERS):
            go_on[layer].wait(5)
            with step.writing():
                written.append(layer)
            step.layer_written(layer)

    step = LayerLoads(LAYERS, [job])
    go_on[0].set()
    assert step.wait(0, 5)
    assert written == [0]
    with step._cond:  # layer 1 not yet (a wait that timed out would cancel the step)
        assert step._reached[1] == 0
    for e in go_on[1:]:
        e.set()
    assert step.join(5)
    assert written == list(range(LAYERS))


def test_every_load_must_be_past_a_layer_and_a_failed_one_releases_the_rest():
    second_may_start = threading.Event()

    def fails_after_layer_0(step: LayerLoads) -> None:
        step.layer_written(0)
        raise RuntimeError("stream cut")

    def second(step: LayerLoads) -> None:
        second_may_start.wait(5)
        for layer in range(LAYERS):
            step.layer_written(layer)

    step = LayerLoads(LAYERS, [fails_after_layer_0, second])
    time.sleep(0.05)
    with step._cond:  # the first job ended: every layer is past it, none past the second
        assert step._reached == [1] * LAYERS
    second_may_start.set()
    for layer in range(LAYERS):
        assert step.wait(layer, 5)
    assert step.join(5)


def test_giving_up_cancels_the_step_and_no_write_follows():
    in_write, release, gave_up = threading.Event(), threading.Event(), threading.Event()
    refused = []

    def job(step: LayerLoads) -> None:
        with step.writing():
            in_write.set()
            release.wait(5)
        gave_up.wait(5)
        try:
            with step.writing():
                pass
        except StepCancelled as e:
            refused.append(e)

    step = LayerLoads(LAYERS, [job])
    assert in_write.wait(5)
    threading.Timer(0.2, release.set).start()
    t0 = time.monotonic()
    assert step.wait(0, 0.05) is False  # gives up: cancels, waiting out the write in progress
    assert time.monotonic() - t0 >= 0.15
    assert step.cancelled
    gave_up.set()
    assert step.join(5)
    assert len(refused) == 1


@pytest.mark.parametrize("jobs", [0, 1])
def test_a_step_without_loads_or_with_an_empty_one_waits_for_nothing(jobs):
    step = LayerLoads(LAYERS, [lambda s: None] * jobs)
    assert all(step.wait(layer, 5) for layer in range(LAYERS))
    assert step.join(5)
