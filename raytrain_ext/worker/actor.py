"""The worker actor: one per device slot, hosting one rank's training loop.

The actor is threaded: ``fit`` runs the training loop in one thread while the
controller calls ``poll`` (heartbeats, rank 0's metrics), ``request_checkpoint``
and ``preempt`` from others without waiting for the loop.

A worker process outlives its process group: ``setup`` may be called again
after a failed or paused ``fit`` (the controller re-forms in place, keeping
survivors), and a spare waits, ``warm``, with torch and the training loop
already imported.  Between groups a survivor keeps its training state in memory
(``live``: :class:`raytrain_ext.train.live_state.LiveState`), which the next
group's ranks take instead of a checkpoint when the layout replicates it.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Dict, Optional

import ray

from raytrain_ext.messages import FitResult, Heartbeat, PollReply, RankInfo, StepReport
from raytrain_ext.user_code import UserCode
from raytrain_ext.worker.process_age import process_age_s
from raytrain_ext.worker.process_pool import (
    adopt_thread_count,
    await_warm_imports,
    import_warm_modules_now,
)
from raytrain_ext.worker.thread_errors import report_thread_errors_in_one_line

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch.distributed import TCPStore

    from raytrain_ext.checkpoint.held_chunks import HeldChunks
    from raytrain_ext.metrics.sinks import RayMetricsSink
    from raytrain_ext.train.live_state import LiveState
    from raytrain_ext.worker.dist_env import WorkerEnv
    from raytrain_ext.worker.rank_loop import RankLoop

# The driver imports this module to create the actors, and needs no torch: what a worker
# runs with torch (``worker.dist_env``, the checkpoint manager's save requests, the fault
# injector) is imported in the methods that run in the worker (in a warm process, already
# imported by ``process_pool.import_warm_modules``).


class EventBuffer:
    """Thread-safe buffer of rank 0's step reports plus the latest heartbeat."""

    def __init__(self, maxlen: int = 100_000):
        self._reports: deque = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.last_step = 0
        self.last_beat = time.time()
        self.phase = "setup"  # what the loop is doing: setup | compute | exchange

    def push(self, report: StepReport, keep: bool) -> None:
        with self._lock:
            self.last_step, self.last_beat = report.step, time.time()
            if keep:
                self._reports.append(report)

    def replay(self, report: StepReport) -> None:
        """Keep an earlier group's report handed over again (``StepReport.replayed``) for
        the records alone: this rank's step and heartbeat stay as they are."""
        with self._lock:
            self._reports.append(report)

    def mark(self, phase: str) -> None:
        self.phase = phase

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(step=self.last_step, phase=self.phase, beat=self.last_beat)

    def drain(self) -> PollReply:
        with self._lock:
            reports = list(self._reports)
            self._reports.clear()
            return PollReply(step=self.last_step, beat=self.last_beat, reports=reports)


def exit_when_orphaned(raylet_pid: int, period_s: float = 1.0) -> threading.Thread:
    """End this process once its raylet (the parent that started it) is gone.

    Why: a worker must not outlive its node.  When a drained node's raylet exited, a
    worker of ours was seen (once, in CI) still sleeping 55 s later, re-parented, its actor
    long dead in the GCS, out of anyone's reach: the raylet that would kill it is gone and
    the SIGTERM that preemption handling catches does not end it.  Checks the parent pid
    every ``period_s`` from a daemon thread."""

    def watch() -> None:
        while os.getppid() == raylet_pid:
            time.sleep(period_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="orphan-watch", daemon=True)
    thread.start()
    return thread


class TrainWorker:
    """Remote methods are called by :class:`raytrain_ext.worker.group.WorkerGroup`."""

    def __init__(self) -> None:
        init_started_at = time.time()
        # first: the setup hook may still be importing torch; without it (no pool, or the
        # job's own hook), what it would have imported is imported here
        if not await_warm_imports():
            import_warm_modules_now()
        # what the imports made lives as long as the process: out of the collector's sight,
        # a full collection (each re-form's teardown runs one, ``dist_env``) takes
        # microseconds instead of 0.14 s (measured: a survivor's teardown, on the recovery
        # path).  Objects made later are collected as before
        gc.freeze()
        # this process's start (``metrics.start_phases``): rank 0's are the group's
        self.marks = {
            "process_started_at": init_started_at - process_age_s(),
            "init_started_at": init_started_at,
            "imports_done_at": time.time(),
        }
        self._reset_run_state()
        self.env: WorkerEnv | None = None
        self.device = None
        # rank 0's rendezvous store, between host_rendezvous and setup
        self.hosted_store: Optional[TCPStore] = None
        self.live: Optional[LiveState] = None  # this process's state from its last group
        self.held: Optional[HeldChunks] = None  # its own shards from that group
        self._loop: Optional[RankLoop] = None  # the running loop, while fit runs
        self.grace_s = 30.0
        adopt_thread_count()  # the same numbers in a stocked process as in a new one
        report_thread_errors_in_one_line()
        # Actor __init__ runs on the process's main thread, where handlers can be installed.
        signal.signal(signal.SIGTERM, self._on_sigterm)
        exit_when_orphaned(os.getppid())

    def _reset_run_state(self) -> None:
        """What one group's run accumulates: heartbeats and records, save requests, the
        SIGTERM mark and rank 0's metrics sink (a former rank 0 may take another rank)."""
        from raytrain_ext.checkpoint.manager import SaveRequests

        self.events = EventBuffer()
        self.requests = SaveRequests()
        self.sigterm_received = False
        self.metrics_sink: Optional[RayMetricsSink] = None

    def _on_sigterm(self, signum, frame) -> None:
        """Preemption notice: checkpoint at the next step boundary, then stop."""
        self.sigterm_received = True
        self.requests.preempt(self.grace_s)

    def request_checkpoint(self) -> None:
        self.requests.on_demand()

    def abort_collectives(self, master_port: int) -> bool:
        """Release the training thread from a collective of the group rendezvoused at
        ``master_port`` (NCCL: abort its communicators) or from a wait on the rollout
        service, when that is still this worker's group: a late call must not abort the
        next group."""
        from raytrain_ext.rollout.waits import abandon_waits
        from raytrain_ext.worker.dist_env import abort_collectives

        if self.env is None or self.env.master_port != master_port:
            return False
        abandon_waits()  # GRPO: a wait on the rollout service is no collective
        return abort_collectives()

    def pause(self) -> None:
        """Stop at the next step boundary, keeping the state in memory (the group grows)."""
        self.requests.pause()

    def preempt(self, grace_s: float) -> None:
        """A drain notice for this worker's node, forwarded by the controller."""
        self.requests.preempt(grace_s)

    def node_info(self) -> RankInfo:
        ctx = ray.get_runtime_context()
        return RankInfo(
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            gpu_ids=[str(g) for g in ray.get_gpu_ids()],
            niceness=os.getpriority(os.PRIO_PROCESS, 0),  # scaling.worker_niceness
            hostname=os.uname().nodename,
            process_age_s=process_age_s(),
            marks=dict(self.marks),
        )

    def serialized_runtime_env(self) -> str:
        """The runtime environment this process was started with, as its raylet matches
        it (``ProcessPool.stock`` asks for idle processes started with the same)."""
        return ray.get_runtime_context().get_runtime_env_string()

    def host_rendezvous(self, timeout_s: float) -> int:
        """Start the rendezvous store this worker will host as rank 0; returns its port."""
        from raytrain_ext.worker.dist_env import host_store

        store = self.hosted_store = host_store(ray.util.get_node_ip_address(), timeout_s)
        return store.port

    def warm(self) -> RankInfo:
        """A spare's start, once ``__init__`` has imported what ``setup`` and ``fit`` need,
        so that taking a dead rank's place costs a rendezvous, not a Python start (about
        2 s for torch alone)."""
        return self.node_info()

    def setup(self, env: Dict[str, Any], backend: str, timeout_s: float) -> str:
        """Join the process group; returns the backend actually used.

        Called again on a survivor after its peers failed: the old groups (already
        broken, their collectives raised) are destroyed first, and the per-run
        buffers start empty, as in a new process.
        """
        from raytrain_ext.worker.dist_env import (
            WorkerEnv,
            choose_backend,
            destroy_distributed,
            init_distributed,
        )

        destroy_distributed()
        self._reset_run_state()
        self.env = WorkerEnv(**env)
        has_gpu = bool(ray.get_gpu_ids())
        chosen = choose_backend(backend, has_gpu)
        store, self.hosted_store = (self.hosted_store if self.env.rank == 0 else None), None
        self.device = init_distributed(self.env, chosen, timeout_s, store)
        return chosen

    def fit(self, cfg: DictConfig, attempt: int = 0, user: Optional[UserCode] = None) -> FitResult:
        """Run this rank's loop with the run's read-only config; ``attempt`` counts
        re-forms (chaos fires on the first ``chaos.attempts`` of them); ``user``: what was
        given from Python.

        The config comes as the controller's typed object (pickled: 1 ms to load), not a
        plain dict: rebuilding it against the schema took 0.07 s on an idle core and
        0.09-0.24 s beside training ranks, on every rank at every re-form."""
        try:
            result = self._train(cfg, attempt, user or UserCode())
        except BaseException as e:
            # the failed loop (and its DDP Reducer) must not outlive the groups it holds:
            # the traceback's frames keep it alive, so their locals go first (dist_env)
            traceback.clear_frames(e.__traceback__)
            self._keep_live_state()
            self._release_peers()
            raise
        if self._loop is not None and self._loop.finished:
            self._loop = None  # the run is complete: no next group takes anything
        self._keep_live_state()
        return replace(result, sigterm=self.sigterm_received)  # the controller avoids its node

    def _keep_live_state(self) -> None:
        """Keep the loop's state at its last step boundary (tensors, not the loop: the
        model's DDP wrapper holds the group and must go with it); a loop that never
        finished building leaves the previous live state in place."""
        loop, self._loop = self._loop, None
        if loop is not None:
            self.live = loop.live_state()
            self.held = loop.held_chunks()

    def _release_peers(self) -> None:
        """Close this rank's gloo connections after it raised: peers blocked in a collective
        with it raise now (and can be kept for a re-form in place) instead of waiting for
        ``parallel.timeout_s``."""
        import torch.distributed as dist

        from raytrain_ext.worker.dist_env import destroy_distributed

        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            destroy_distributed()

    def _train(self, cfg: DictConfig, attempt: int, user: UserCode) -> FitResult:
        from raytrain_ext.faults import FaultInjector
        from raytrain_ext.metrics.sinks import RayMetricsSink
        from raytrain_ext.train.loop import TrainLoop

        assert self.env is not None, "setup() must run before fit()"
        faults = FaultInjector(cfg.chaos, self.env.rank, attempt)
        self.grace_s = cfg.checkpoint.preemption_grace_s
        is_rank0 = self.env.rank == 0
        if is_rank0:
            self.metrics_sink = RayMetricsSink(cfg.run.name)
        built: Dict[str, float] = {"fit_started_at": time.time()}  # for the first record

        def report(step_report: StepReport) -> None:
            if step_report.replayed:  # for the records alone: no marks, metrics or step
                self.events.replay(step_report)
                return
            if built:  # the group's first step: when this rank's loop was built, and how
                marks = self._loop.build_marks if self._loop is not None else {}
                step_report.start_marks = {**marks, **built}
                built.clear()
            self.events.push(step_report, keep=is_rank0)
            if self.metrics_sink is not None:
                self.metrics_sink.write(step_report.step, step_report.to_record())

        loop: RankLoop
        if user.train_loop is not None:
            from raytrain_ext.user_loop.function_loop import FunctionLoop

            loop = FunctionLoop(
                cfg, self.env, report, self.requests, self.events.mark, user.train_loop
            )
        else:
            loop = TrainLoop(
                cfg,
                self.env.rank,
                self.env.world_size,
                self.env.local_rank,
                self.device,
                report,
                self.requests,
                faults=faults,
                mark=self.events.mark,
                user=user,
                live=self.live,
                held=self.held,
            )
        self._loop, self.live, self.held = loop, None, None  # the loop holds the state now
        built["built_at"] = time.time()
        faults.after_restore()
        return loop.fit()

    def dump_stacks(self) -> str:
        """Every thread's Python stack, readable while the training thread is stuck.

        The actor is threaded, so this runs beside a hung loop; ``sys._current_frames``
        needs no ptrace permission (which ``py-spy`` would) and works in any container.
        """
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = []
        for ident, frame in sys._current_frames().items():
            parts.append(
                f"--- thread {names.get(ident, '?')} ({ident}), phase "
                f"{self.events.phase}, last step {self.events.last_step}\n"
            )
            parts.append("".join(traceback.format_stack(frame)))
        return "\n".join(parts)

    def poll(self) -> PollReply:
        return self.events.drain()

    def heartbeat(self) -> Heartbeat:
        return self.events.heartbeat()

    def shutdown(self) -> None:
        from raytrain_ext.worker.dist_env import destroy_distributed

        destroy_distributed()


def remote_worker_class(max_concurrency: int = 4):
    return ray.remote(max_concurrency=max_concurrency)(TrainWorker)
