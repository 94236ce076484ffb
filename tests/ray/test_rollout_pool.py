"""Rollout engines as Ray actors (raytrain_ext.rollout.pool), through a SIGKILLed engine
process: no prompt group is lost, repeated or split, the re-issued groups generate what the
lost engine would have (each completion from its own seed), and the replacement engine
takes the trainers' current weights from the object store, not from a file."""

import os
import signal

from raytrain_ext.rollout.engine import GroupRequest, HFGenerateEngine, RolloutSettings
from tests.helpers.hf_models import tiny_policy
from tests.helpers.leaks import assert_nothing_left

SETTINGS = RolloutSettings(
    num_generations=3, max_completion_length=8, seed=11, eos_token_id=3, pad_token_id=0
)


def requests(step: int):
    return [GroupRequest(i, tuple(range(1 + i, 5 + i)), step) for i in range(6)]


def test_a_killed_engine_loses_no_group_and_its_replacement_takes_the_current_weights(
    ray_local,
):
    from raytrain_ext.rollout.pool import EnginePool

    trained = tiny_policy(seed=6).state_dict()  # the trainers' weights at step 3
    reference = HFGenerateEngine(tiny_policy(), SETTINGS)
    reference.load_weights(trained, version=3)
    pool = EnginePool(tiny_policy, SETTINGS, engines=2, actor_options={"num_cpus": 1})
    try:
        pool.load_weights(trained, version=3)
        (_, first_pid), (_, lost_pid) = pool.placements()
        os.kill(lost_pid, signal.SIGKILL)
        got = pool.generate(requests(step=4))
        assert got == reference.generate(requests(step=4))  # whole, in order, same tokens
        (recovery,) = pool.recoveries
        assert (recovery.engine, recovery.fate, recovery.groups_reissued) == (
            1,
            "process_died",
            3,
        )
        (_, kept), (_, replacement) = pool.placements()
        assert kept == first_pid and replacement not in (lost_pid, first_pid)
        again = pool.generate(requests(step=5))  # the replacement generates its share
        assert again == reference.generate(requests(step=5))
        assert {g.weights_version for g in got + again} == {3}
    finally:
        pool.shutdown()
    assert_nothing_left()
