"""Who gives a rank's process its variables: its runtime environment, or its raylet."""

from raytrain_ext.worker.process_env import rank_env_vars, runtime_env_beyond


def test_a_rank_needs_no_runtime_env_only_where_its_raylet_gives_every_variable(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    ranks = rank_env_vars(5, {})
    assert ranks == {"RAY_worker_niceness": "5", "MALLOC_ARENA_MAX": "1"}
    assert runtime_env_beyond(ranks, ranks) == {}
    assert runtime_env_beyond(ranks, {**ranks, "OTHER": "x"}) == {}
    # one missing or different: all of them, as on a cluster
    assert runtime_env_beyond(ranks, {"RAY_worker_niceness": "5"}) == {"env_vars": ranks}
    assert runtime_env_beyond(ranks, {**ranks, "MALLOC_ARENA_MAX": "2"}) == {"env_vars": ranks}
    assert runtime_env_beyond(ranks, {}) == {"env_vars": ranks}


def test_the_users_arena_setting_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # a private Ray's raylet inherits it
    assert rank_env_vars(0, {}) == {"RAY_worker_niceness": "0"}
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert rank_env_vars(0, {"MALLOC_ARENA_MAX": "2"}) == {"RAY_worker_niceness": "0"}
