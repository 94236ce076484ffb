"""Ray's worker pool, kept stocked with one idle interpreter per node, torch imported.

Why: a dead rank replaced in place waits for its new process, and on the machines
measured here that start was the largest phase of the recovery (about 3 s, nearly all
of it importing torch and the training loop).  A raylet can start idle worker processes
for a job ahead of time (its ``PrestartWorkers`` call, which Ray itself uses for a
job's first driver) and gives one to the next actor created on that node with the same
runtime environment.  Our actors' runtime environment names a setup hook (Ray's
``worker_process_setup_hook``, run by every worker process before it takes work) that
imports :data:`WARM_MODULES`, so an idle process already has them when it is taken.

This is not a warm spare: it holds no slot, no CPU or GPU, no model and no data, only
its memory (about 300 MB here); the raylet ends it after ``keep_alive_s`` or with the job.

Invariants: stocking is best effort, so a raylet that refuses (another Ray version, a
node just lost) costs one warning and the recovery starts a process as before.  A pool
asks each node at most once until a re-form takes its process (``taken``), refused or not:
the controller refills the pool at every poll while the group is below its maximum.  Runs one after
another in one job (a notebook) do not pile them up: a new run's actors take the previous
run's idle process on their node before its pool asks for one.  A job whose own
runtime environment sets a setup hook keeps it: our actors then start without ours.
Only the group's ranks are created with the hook's environment, so only they can take a
stocked process (a spare, which warms up by itself, starts with the caller's); a
rank's new process was a stocked one exactly when it is older than the time since it
was asked for, each read on its own clock (``WorkerGroup``).  On a Ray this driver has
just started for the run (``fresh_ray``) no earlier run can have stocked one, so the
first group's ranks start with the caller's environment instead, which is empty there
(``worker.process_env``): a process with no runtime environment starts without Ray's
setup interpreter.

A stocked process announces itself once its imports are done (a key in Ray's internal
key-value store naming its job, node and pid) and withdraws when an actor takes it, so a
recovery can tell a lost rank whose node has a warm process waiting from one whose new
process would still be importing (``elastic.replacement=auto``, ``warm_nodes``).  A
process that dies idle (the raylet's keep-alive ends, an OOM kill) leaves its key: the
recovery then waits for a process start, as without a pool.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Dict, Iterable, Optional, Set, Tuple

import ray
from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR

from raytrain_ext.collector import collection_paused

log = logging.getLogger(__name__)

# What a first ``fit`` imports (measured: ``sys.modules`` after a spare's first step), so a
# spare or a stocked process pays none of it on the recovery path.  ``torch._dynamo``
# (imported by the first DDP construction) alone takes 0.5-2 s, and the peers wait for it
# in DDP's first broadcast.  Every rank of a new group imports these before its first
# step too (its process runs the same hook), so nothing a fit does not import belongs
# here (pandas, 0.1-0.3 s, left when the data path stopped importing it).  They are
# imported with the garbage collector paused (``raytrain_ext.collector``): its six full
# collections took 0.5-0.8 s of the 2.0-2.3 s otherwise.
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "pyarrow.compute",
    "pyarrow.json",
    "pydantic",
    "raytrain_ext.train.loop",
    "raytrain_ext.checkpoint.manager",
    "raytrain_ext.checkpoint.tiers.memory",
)

SETUP_HOOK = f"{__name__}.import_warm_modules"
WARM_NAMESPACE = "raytrain_ext_pool"

# the setup hook's import thread in this process (one hook per process; None: no hook)
_warming: Optional[threading.Thread] = None


def import_warm_modules() -> None:
    """The setup hook: start importing :data:`WARM_MODULES` on a thread of the lowest CPU
    priority (``SCHED_IDLE``), and return; the actor that takes the process waits for
    it (:func:`await_warm_imports`).

    Why: a stocked process imports while the node's ranks train, and at the ranks'
    priority its 3-4 s of CPU came out of their steps (measured: steps 2-7 of the HF
    bench 1.1-1.4 s against 0.7 s).  At ``SCHED_IDLE`` it runs only on a core no rank
    wants.  The policy is the thread's own (Linux schedules threads), so the process's
    main thread, which will run the actor, keeps its priority.  The hook returns at once
    (Ray hands a process work only once its hook has returned, and a process taken in a
    recovery must not wait at idle priority for CPUs the ranks no longer use).  Never
    raises (a hook that raises makes Ray end the process, and with it the actor it was
    started for): a module that fails here fails again, with its real error, where the
    loop imports it."""
    global _warming
    _warming = threading.Thread(target=_import_at_idle_priority, name="warm-imports", daemon=True)
    _warming.start()


def await_warm_imports() -> bool:
    """Wait for the setup hook's imports, at the caller's priority where the process may
    raise the thread's (``CAP_SYS_NICE``: an unprivileged thread cannot leave
    ``SCHED_IDLE``, and then they finish at idle priority); whether this process ran the
    hook.

    Invariant: the actor calls this before anything of its own touches torch.  Two
    threads importing torch at once fail (``c10d_init`` raised when the actor's module
    imported ``torch.distributed`` beside the hook's thread), so the actor's module
    imports no torch at its top (``worker.actor``)."""
    thread = _warming
    if thread is None:
        return False
    if thread.is_alive() and thread.native_id is not None:
        try:
            os.sched_setscheduler(thread.native_id, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError) as e:  # unprivileged, or not Linux
            log.debug("warm imports stay at idle priority: %s", e)
    thread.join()
    _kv(lambda kv: kv._internal_kv_del(_warm_key(), namespace=WARM_NAMESPACE))  # taken
    return True


def import_warm_modules_now() -> None:
    """Import :data:`WARM_MODULES` on this thread, in a process the setup hook did not
    run in (no pool, or the job's own hook)."""
    with collection_paused():
        for module in WARM_MODULES:
            importlib.import_module(module)


def _import_at_idle_priority() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
    except (AttributeError, OSError) as e:  # not Linux: imports at the process's priority
        log.debug("setup hook: no SCHED_IDLE here: %s", e)
    with collection_paused():
        for module in WARM_MODULES:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - reported where it is really imported
                log.debug("setup hook: %s did not import: %s", module, e)
    _kv(lambda kv: kv._internal_kv_put(_warm_key(), b"", namespace=WARM_NAMESPACE))


def _warm_prefix(job_id: str) -> str:
    return f"warm/{job_id}/"


def _warm_key() -> str:
    """This process's key: its job (stocked processes are per job), node and pid."""
    ctx = ray.get_runtime_context()
    return f"{_warm_prefix(ctx.get_job_id())}{ctx.get_node_id()}/{os.getpid()}"


def _kv(call) -> None:
    """Best effort, as stocking is (module doc): a missing key costs a recovery its
    choice, not the process.  Only in a process connected to Ray (asking a bare one for
    its context would start a cluster)."""
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        return
    try:
        call(internal_kv)
    except Exception as e:  # noqa: BLE001 - best effort
        log.debug("warm-process key not updated: %s", e)


def adopt_thread_count() -> None:
    """Run torch with as many threads as Ray gave this actor (``OMP_NUM_THREADS``, set when
    the actor takes the process).  A stocked process imported torch before that, so its
    OpenMP runtime read no such variable and would use every core; the thread count
    changes how CPU kernels split their sums, so without this the run's numbers would
    depend on which kind of process a rank got."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


class ProcessPool:
    """One idle, warmed process per node of the gang, asked of each node's raylet."""

    def __init__(self, keep_alive_s: int = 24 * 3600, fresh_ray: bool = False):
        self.keep_alive_s = keep_alive_s
        self.fresh_ray = fresh_ray  # a private Ray this driver started for this run
        # (node id, serialized runtime env) asked for an idle process, not taken since
        self._stocked: Set[Tuple[str, str]] = set()

    def runtime_env(self, runtime_env: Optional[dict]) -> dict:
        """``runtime_env`` (the actors' own, or none) with the setup hook added, unless the
        job's environment already sets one."""
        env = dict(runtime_env or {})
        job_vars = ray.get_runtime_context().runtime_env.get("env_vars") or {}
        if WORKER_PROCESS_SETUP_HOOK_ENV_VAR in job_vars:
            return env
        env["env_vars"] = {**env.get("env_vars", {}), WORKER_PROCESS_SETUP_HOOK_ENV_VAR: SETUP_HOOK}
        return env

    def first_group_env(self, runtime_env: Optional[dict]) -> dict:
        """The environment of the first group's ranks: :meth:`runtime_env`'s, to take an
        earlier run's stocked process, except on a fresh Ray (module doc)."""
        return dict(runtime_env or {}) if self.fresh_ray else self.runtime_env(runtime_env)

    def warm_processes(self) -> Set[Tuple[str, int]]:
        """(node id, pid) of each stocked process of this job whose imports are done and
        that waits for an actor (module doc); none when the store cannot be read (a
        recovery then goes on without waiting, as for a cold process)."""
        from ray.experimental import internal_kv

        prefix = _warm_prefix(ray.get_runtime_context().get_job_id())
        try:
            keys = internal_kv._internal_kv_list(prefix, namespace=WARM_NAMESPACE)
        except Exception as e:  # noqa: BLE001 - best effort (module doc)
            log.warning("could not read which nodes hold a warm process: %s", e)
            return set()
        places = (key.decode()[len(prefix) :].split("/") for key in keys)
        return {(node, int(pid)) for node, pid in places}

    def warm_nodes(self) -> Set[str]:
        """The nodes of :meth:`warm_processes`."""
        return {node for node, _ in self.warm_processes()}

    def taken(self, node_id: str, serialized_runtime_env: str) -> None:
        """A re-form started an actor on a stocked process of ``node_id``."""
        self._stocked.discard((node_id, serialized_runtime_env))

    def stock(self, node_ids: Iterable[str], serialized_runtime_env: str) -> None:
        """Ask each node of ``node_ids`` not asked yet for one idle process started with
        ``serialized_runtime_env`` (exactly what our actors run with: the raylet matches
        it byte for byte)."""
        wanted = {n for n in node_ids if (n, serialized_runtime_env) not in self._stocked}
        if not wanted:
            return
        raylets = _raylet_addresses()
        job = bytes.fromhex(ray.get_runtime_context().get_job_id())
        for node_id in sorted(wanted):
            address = raylets.get(node_id)
            if address is None:
                continue  # lost since: nothing to stock
            self._stocked.add((node_id, serialized_runtime_env))  # asked: once (module doc)
            try:
                _prestart(address, job, serialized_runtime_env, self.keep_alive_s)
            except Exception as e:  # noqa: BLE001 - best effort (module doc)
                log.warning("could not prestart a worker process on %s: %s", address, e)


def _raylet_addresses() -> Dict[str, str]:
    """Alive node id -> its raylet's gRPC address."""
    return {
        n["NodeID"]: f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}"
        for n in ray.nodes()
        if n["Alive"]
    }


def _prestart(address: str, job_id: bytes, serialized_runtime_env: str, keep_alive_s: int) -> None:
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    request = node_manager_pb2.PrestartWorkersRequest(
        language=common_pb2.Language.PYTHON,
        job_id=job_id,
        keep_alive_duration_secs=keep_alive_s,
        num_workers=1,
    )
    request.runtime_env_info.serialized_runtime_env = serialized_runtime_env
    channel = init_grpc_channel(address)
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=5)
    finally:
        channel.close()
