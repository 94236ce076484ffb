"""``worker/priority.py``: the niceness our actors' runtime environment asks Ray for."""

from raytrain_ext.worker.priority import NICENESS_ENV_VAR, with_niceness


def test_the_niceness_is_added_to_the_actors_environment_without_changing_the_callers():
    callers = {"env_vars": {"A": "1"}, "working_dir": "."}
    env = with_niceness(callers, 0)
    assert env == {"env_vars": {"A": "1", NICENESS_ENV_VAR: "0"}, "working_dir": "."}
    assert callers == {"env_vars": {"A": "1"}, "working_dir": "."}
    assert with_niceness(None, 7) == {"env_vars": {NICENESS_ENV_VAR: "7"}}


def test_a_runtime_environment_that_sets_the_niceness_keeps_it():
    env = with_niceness({"env_vars": {NICENESS_ENV_VAR: "10"}}, 0)
    assert env["env_vars"][NICENESS_ENV_VAR] == "10"
