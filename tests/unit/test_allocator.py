"""``worker.allocator``: the ranks' runtime environment asks glibc for one malloc arena,
unless the user already chose."""

from raytrain_ext.worker.allocator import ARENA_ENV_VAR, with_one_malloc_arena


def test_one_arena_is_added_and_the_given_environment_is_not_modified(monkeypatch):
    monkeypatch.delenv(ARENA_ENV_VAR, raising=False)
    given = {"env_vars": {"RAY_worker_niceness": "0"}, "pip": ["x"]}
    env = with_one_malloc_arena(given)
    assert env == {"env_vars": {"RAY_worker_niceness": "0", ARENA_ENV_VAR: "1"}, "pip": ["x"]}
    assert given == {"env_vars": {"RAY_worker_niceness": "0"}, "pip": ["x"]}
    assert with_one_malloc_arena(None)["env_vars"] == {ARENA_ENV_VAR: "1"}


def test_a_value_the_user_chose_is_kept(monkeypatch):
    monkeypatch.delenv(ARENA_ENV_VAR, raising=False)
    ours = {"env_vars": {ARENA_ENV_VAR: "4"}}
    assert with_one_malloc_arena(ours)["env_vars"] == {ARENA_ENV_VAR: "4"}
    assert with_one_malloc_arena(None, {ARENA_ENV_VAR: "2"})["env_vars"] == {}  # the job's
    monkeypatch.setenv(ARENA_ENV_VAR, "8")  # the shell's, inherited by a private Ray
    assert with_one_malloc_arena(None)["env_vars"] == {}
