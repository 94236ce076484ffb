"""The process pool's pieces that run in a worker process before Ray hands it an actor."""

import gc
import os

import pytest

from raytrain_ext.collector import collection_paused
from raytrain_ext.worker import process_age, process_pool
from tests.helpers.imports import Interpreter


def _run(code: str, **env) -> str:
    """``code`` in a new interpreter (this one has imported everything already)."""
    return Interpreter(code, env).output()


@pytest.fixture(scope="module")
def interpreters():
    """The new interpreters of the tests that only read what one did, started together so
    that the cores run them side by side (this module: 8-9 s against 12-13 s one after
    another).  The priority test below runs alone: its timing must not depend on other
    processes' load."""
    return {
        "hook": Interpreter(
            """
            import gc, sys, torch, torch.cuda
            calls = []
            for name in ("device_count", "is_available", "_lazy_init", "init", "current_device"):
                real = getattr(torch.cuda, name)
                def spy(*a, _n=name, _real=real, **k):
                    calls.append(_n)
                    return _real(*a, **k)
                setattr(torch.cuda, name, spy)
            from raytrain_ext.worker.process_pool import (
                WARM_MODULES, await_warm_imports, import_warm_modules,
            )
            collections = gc.get_stats()[2]["collections"]  # full collections
            import_warm_modules()
            await_warm_imports()
            during = gc.get_stats()[2]["collections"] - collections
            print(calls, [m for m in WARM_MODULES if m not in sys.modules], during, gc.isenabled())
            """
        ),
        "threads": Interpreter(
            """
            import os, torch
            before = torch.get_num_threads()
            os.environ["OMP_NUM_THREADS"] = "1"
            from raytrain_ext.worker.process_pool import adopt_thread_count
            adopt_thread_count()
            print(before, torch.get_num_threads())
            """,
            {"OMP_NUM_THREADS": ""},
        ),
        "age": Interpreter(
            """
            import time
            time.sleep(1.0)
            from raytrain_ext.worker.process_age import process_age_s
            print(process_age_s())
            """
        ),
    }


def test_the_setup_hook_imports_the_warm_modules_without_asking_cuda_anything(interpreters):
    """Ray sets CUDA_VISIBLE_DEVICES only when an actor takes the process: the hook runs
    before, so nothing it imports may query CUDA (the driver would fix its device list).
    The garbage collector runs no collection during those imports, and runs again after
    (``raytrain_ext.collector``)."""
    assert interpreters["hook"].output() == "[] [] 0 True"


def test_a_module_that_fails_to_import_does_not_fail_the_hook(monkeypatch):
    monkeypatch.setattr(process_pool, "WARM_MODULES", ("json", "no_such_module_here"))
    process_pool.import_warm_modules()  # a raising hook would end the process and its actor
    process_pool.await_warm_imports()


def test_a_process_without_the_hook_imports_with_the_collector_paused(monkeypatch, tmp_path):
    """The actor's own imports (no pool, or the job's own hook) pause the collector too,
    and leave it as they found it."""
    (tmp_path / "records_the_collector.py").write_text("import gc\nENABLED = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(process_pool, "WARM_MODULES", ("records_the_collector",))
    process_pool.import_warm_modules_now()
    import records_the_collector

    assert records_the_collector.ENABLED is False and gc.isenabled()


def test_a_paused_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_thread_count_follows_what_ray_gave_the_actor_not_the_import(interpreters):
    """torch imported with no OMP_NUM_THREADS (a stocked process) uses every core; once
    the actor's variable is set, ``adopt_thread_count`` brings it to that."""
    before, after = map(int, interpreters["threads"].output().split())
    assert after == 1 and before >= after


def test_process_age_is_read_on_the_kernel_clock(interpreters):
    age = float(interpreters["age"].output())  # an interpreter that slept 1 s
    assert 1.0 <= age < 30
    assert process_age.process_age_s() > age  # this test's process started earlier


def test_the_hook_imports_at_idle_priority_until_an_actor_waits_for_it(tmp_path):
    """A stocked process imports on a ``SCHED_IDLE`` thread (a core no rank wants); the
    actor that takes it raises that thread to its own priority where it may (root here:
    ``CAP_SYS_NICE``) and waits for the imports; the main thread never leaves its own."""
    (tmp_path / "slow_module.py").write_text(
        "import os, time\ntime.sleep(0.6)\nPOLICY_AT_END = os.sched_getscheduler(0)\n"
    )
    out = _run(
        """
        import os, time
        from raytrain_ext.worker import process_pool
        process_pool.WARM_MODULES = ("slow_module",)
        process_pool.import_warm_modules()
        time.sleep(0.2)
        while_warming = os.sched_getscheduler(process_pool._warming.native_id)
        process_pool.await_warm_imports()
        import slow_module
        print(while_warming == os.SCHED_IDLE, slow_module.POLICY_AT_END == os.SCHED_OTHER,
              os.sched_getscheduler(0) == os.SCHED_OTHER, process_pool._warming.is_alive())
        """,
        PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    privileged = os.geteuid() == 0
    assert out == f"True {privileged} True False"
