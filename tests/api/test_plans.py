"""Fetch plans: the fewest bytes from what a worker holds to the newest version."""

from echo2.protocol import Form

from api.services.plans import Forms, plan

FULL, DELTA = 1000, 10


def chain(n: int, keyframes: set[int]) -> dict[int, Forms]:
    """Versions 0..n-1, each a delta of the one before; keyframes also in full."""
    return {v: Forms(FULL if v in keyframes else None, DELTA if v else None, v - 1 if v else None) for v in range(n)}


def test_a_holder_of_the_version_before_takes_one_delta():
    assert plan(chain(5, {0}), 4, {3}) == [(4, Form.delta)]


def test_a_newcomer_takes_the_newest_keyframe_and_the_deltas_after_it():
    assert plan(chain(6, {0, 3}), 5, set()) == [(3, Form.full), (4, Form.delta), (5, Form.delta)]


def test_a_keyframe_beats_a_long_chain_of_deltas_when_it_is_cheaper():
    forms = {0: Forms(FULL, None, None), **{v: Forms(None, 400, v - 1) for v in range(1, 4)}, 4: Forms(FULL, 400, 3)}
    assert plan(forms, 4, {0}) == [(4, Form.full)]  # 1000 < 4 x 400
    assert plan(forms, 3, {0}) == [(1, Form.delta), (2, Form.delta), (3, Form.delta)]  # 1200 < nothing else


def test_holding_the_target_needs_nothing_and_a_gap_with_no_keyframe_has_no_path():
    assert plan(chain(3, {0}), 2, {2}) == []
    gapped = {0: Forms(FULL, None, None), 2: Forms(None, DELTA, 1)}  # version 1 was collected
    assert plan(gapped, 2, set()) is None


def test_a_lora_adapter_comes_with_its_base_for_a_worker_that_lacks_it():
    forms = {0: Forms(FULL, None, None), 1: Forms(5, None, None, adapter_base=0), 2: Forms(5, None, None, 0)}
    assert plan(forms, 2, set()) == [(0, Form.full), (2, Form.full)]
    assert plan(forms, 2, {0, 1}) == [(2, Form.full)]
