"""The controller's state machine, stepped with a fake worker group, cluster and clock.

Unit rung: no Ray.  ``FakeGroup`` plays a group's ``fit`` one step per wait (the
clock advances by the poll interval), ``FakeCluster`` has nodes of one-worker
slots, and ``FakeClock.sleep`` stands in for waiting, so every recovery path runs
in milliseconds.  The asserts read what a run leaves behind: the transitions,
the recovery and resize records as summary.json gets them, the forwarded steps.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import pytest
import ray

from raytrain_ext.config import load_config
from raytrain_ext.elastic.controller import Controller, TrainingFailed
from raytrain_ext.elastic.decision import Evidence, Fate
from raytrain_ext.elastic.group_port import FitStatus
from raytrain_ext.elastic.in_place import InPlacePlan, sized
from raytrain_ext.elastic.policy import Action, ScalingPolicy
from raytrain_ext.elastic.records import Recovery, RecoveryKind, RunState
from raytrain_ext.messages import FitResult, Heartbeat, PollReply, RankInfo, StepReport

START = 1000.0
POLL_S = 0.25  # a binary fraction: the fake clock adds it up exactly


class WorkerDied(RuntimeError):
    """Stands in for Ray's ActorDiedError."""


class NonFiniteLossError(RuntimeError):
    """Same name as the loop's deterministic failure, which is never retried."""


class FakeClock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeCluster:
    """Nodes of one-CPU worker slots; what the group holds is not free.  A removed node
    is no longer listed and never answers a ping."""

    def __init__(self, slots: Dict[str, int]) -> None:
        self.slots = dict(slots)
        self.draining: Dict[str, float] = {}
        self.group: Optional["FakeGroup"] = None

    def free_resources(self) -> Dict[str, Dict[str, float]]:
        used = self.group.used_slots() if self.group else {}
        return {n: {"CPU": float(k - used.get(n, 0))} for n, k in self.slots.items()}

    def node_probe(self, nodes, known_alive) -> "FakeProbe":
        return FakeProbe(self, set(nodes) | set(known_alive))

    def draining_nodes(self) -> Dict[str, float]:
        return dict(self.draining)


class FakeProbe:
    def __init__(self, cluster: FakeCluster, nodes: set) -> None:
        self.cluster, self.nodes = cluster, nodes

    def add(self, nodes) -> None:
        self.nodes |= set(nodes)

    def answered(self, timeout_s: float) -> set:
        return {n for n in self.nodes if n in self.cluster.slots}


@dataclass
class Fault:
    """On ``attempt``, once step ``after_step`` is done: ``rank`` raises ``error`` (its
    process dead when ``dead``; its node gone too when ``lose_node``), or hangs."""

    attempt: int
    after_step: int
    rank: int
    error: Optional[BaseException] = None
    dead: bool = True
    lose_node: bool = False

    @property
    def hang(self) -> bool:
        return self.error is None


class FakeGroup:
    """``GroupPort`` without Ray.  Every ``wait_fit`` is one training step of every rank;
    rank 0's records wait in ``pending`` for a ``poll``.  A checkpoint is committed
    every ``ckpt_every`` steps (and at a preemption); a new group resumes from it."""

    def __init__(self, cluster: FakeCluster, clock: FakeClock, max_steps: int, ckpt_every=2):
        self.cluster, self.clock = cluster, clock
        self.max_steps, self.ckpt_every = max_steps, ckpt_every
        cluster.group = self
        self.avoid_nodes: set = set()
        self.infos: List[RankInfo] = []
        self.backend: Optional[str] = None
        self.world = 0
        self.calls: List[tuple] = []
        self.faults: List[Fault] = []
        self.at_step: Dict[int, Callable[[], None]] = {}  # run once the step is done
        self.evidence: Optional[Evidence] = None  # what gather_evidence answers
        self.spares_ready = 0  # warm spares waiting in the gang's slots
        self.pausing = False
        self.paused_at: Optional[int] = None
        self.attempt, self.committed, self.step, self.first = 0, 0, 0, True
        self.pending: List[StepReport] = []
        self.stopping = False
        self.preempted_at: Optional[int] = None
        self.fault: Optional[Fault] = None
        self.start_marks: Dict[str, float] = {}  # set by each start and reform
        # attempt -> the steps its rank 0 hands over again before its first (``replayed``)
        self.replays: Dict[int, List[int]] = {}

    @property
    def world_size(self) -> int:
        return self.world

    def used_slots(self) -> Dict[str, int]:
        used: Dict[str, int] = {}
        for info in self.infos[: self.world]:
            used[info.node_id] = used.get(info.node_id, 0) + 1
        return used

    def start(self, num_workers, form, *, spares):
        self.calls.append(("start", num_workers))
        slots = [
            node
            for node, k in self.cluster.slots.items()
            if node not in self.avoid_nodes
            for _ in range(k)
        ]
        if len(slots) < num_workers + spares:
            raise TimeoutError(f"could not place {num_workers} workers")
        self.infos = [_info(node, rank) for rank, node in enumerate(slots[:num_workers])]
        self.world, self.backend = num_workers, "gloo"
        self.start_marks = {"placed_at": self.clock(), "formed_at": self.clock()}

    def reform(self, plan, form):
        """Kept ranks keep their state: the new group resumes where they stopped."""
        self.calls.append(("reform", list(plan.keep), plan.size))
        spares = min(self.spares_ready, plan.size - len(plan.keep))
        self.spares_ready -= spares
        started = plan.size - len(plan.keep) - spares
        self.world, self.committed = plan.size, self.step
        self.start_marks = {"formed_at": self.clock()}
        return {"kept": len(plan.keep), "spares_used": spares, "started": started}

    def start_fit(self, cfg, attempt):
        self.attempt, self.step, self.first = attempt, self.committed, True
        self.stopping, self.preempted_at = False, None
        self.pausing, self.paused_at = False, None
        self.fault = next((f for f in self.faults if f.attempt == attempt), None)
        self.pending += [
            StepReport(step=step, time=self.clock(), step_time_s=0.0, loss=1.0, replayed=True)
            for step in self.replays.get(attempt, [])
        ]

    def wait_fit(self, timeout_s):
        self.clock.sleep(timeout_s)
        fault = self.fault
        if fault is not None and self.step >= fault.after_step:
            if fault.lose_node:
                self.cluster.slots.pop(self.infos[fault.rank].node_id, None)
            return FitStatus(False) if fault.hang else FitStatus(False, (fault.rank, fault.error))
        if self.stopping:
            self.preempted_at = self.committed = self.step
            return FitStatus(True)
        if self.pausing:
            self.paused_at = self.step
            return FitStatus(True)
        self._train_step(timeout_s)
        if fault is not None and self.step >= fault.after_step >= self.max_steps:
            # lost after the last step: rank 0 has returned from the run meanwhile
            return FitStatus(False, (fault.rank, fault.error), {0: FitResult(0, self.step)})
        return FitStatus(self.step >= self.max_steps)

    def _train_step(self, seconds: float) -> None:
        self.step += 1
        report = StepReport(step=self.step, time=self.clock(), step_time_s=seconds, loss=1.0)
        if self.first:
            phases = {"fetch_s": 0.5}
            restored = {"step": self.committed, "total_s": 0.5, "tier": "memory", "phases": phases}
            restored.update(read_bytes=3000, held_bytes=1000)
            report.first_of_group, report.restored = True, restored if self.committed else None
            report.start_marks = {"built_at": self.clock() - seconds}
            self.first = False
        self.pending.append(report)
        if self.step % self.ckpt_every == 0:
            self.committed = self.step
        self.at_step.pop(self.step, lambda: None)()

    def _alive(self, rank: int) -> bool:
        fault = self.fault
        return rank < self.world and not (
            fault and fault.dead and rank == fault.rank and self.step >= fault.after_step
        )

    def fit_results(self):
        return [
            FitResult(r, self.step, preempted_at=self.preempted_at, paused_at=self.paused_at)
            for r in range(self.world)
        ]

    def heartbeats(self, timeout_s):
        hung = self.fault.rank if self.fault and self.fault.hang else None
        return {
            r: Heartbeat(self.step, "compute" if r == hung else "exchange")
            for r in range(self.world)
            if self._alive(r)
        }

    def poll(self, ranks, timeout_s):
        answers = {}
        for r in ranks:
            if self._alive(r):
                records, self.pending = (self.pending, []) if r == 0 else ([], self.pending)
                answers[r] = PollReply(self.step, reports=records)
        return answers

    def preempt(self, ranks, grace_s):
        self.calls.append(("preempt", list(ranks), grace_s))
        self.stopping = True

    def request_checkpoint(self):
        self.calls.append(("request_checkpoint",))

    def gather_evidence(self, hung_ranks, wait_s, evidence_s):
        self.calls.append(("gather_evidence", list(hung_ranks)))
        return self.evidence

    def ready_spare_count(self):
        return self.spares_ready

    def pause(self):
        self.calls.append(("pause",))
        self.pausing = True

    def replenish(self, spares):
        self.calls.append(("replenish", spares))

    def dump_stacks(self, out, attempt):
        self.calls.append(("dump_stacks", attempt))

    def shutdown(self):
        self.calls.append(("shutdown",))
        self.world = 0


def _info(node: str, rank: int) -> RankInfo:
    return RankInfo(node_id=node, node_ip=f"10.0.0.{node.removeprefix('n')}", pid=1000 + rank)


class ListSink:
    def __init__(self) -> None:
        self.rows: List[dict] = []

    def write(self, step, record) -> None:
        self.rows.append(dict(record))


@dataclass
class Run:
    controller: Controller
    group: FakeGroup
    cluster: FakeCluster
    clock: FakeClock
    sink: ListSink

    def states(self) -> List[str]:
        transitions = self.controller.result.transitions
        return [transitions[0].source] + [t.target for t in transitions]

    def steps(self) -> List[int]:
        return [r["step"] for r in self.controller.result.records]


def make_run(slots: Dict[str, int], overrides=(), max_steps=8, faults=()) -> Run:
    cfg = load_config(
        None,
        [
            f"run.max_steps={max_steps}",
            f"elastic.poll_interval_s={POLL_S}",
            "elastic.wait_for_capacity_s=0",
            *overrides,
        ],
    )
    clock, cluster, sink = FakeClock(), FakeCluster(slots), ListSink()
    group = FakeGroup(cluster, clock, max_steps)
    group.faults = list(faults)
    controller = Controller(
        cfg, sink, clock, group_factory=lambda _: group, cluster=cluster, sleep=clock.sleep
    )
    return Run(controller, group, cluster, clock, sink)


@pytest.fixture(autouse=True)
def no_ray():
    """The state machine runs without Ray: none is running (an earlier test's is stopped;
    the next test that needs one starts it again) and none is started."""
    if ray.is_initialized():
        ray.shutdown()
    yield
    assert not ray.is_initialized()


def test_start_run_finish():
    run = make_run({"n1": 1, "n2": 1}, max_steps=4)
    result = run.controller.run()
    assert run.states() == ["SCHEDULING", "RUNNING", "FINISHED"]
    assert result.state is RunState.FINISHED and result.backend == "gloo"
    assert result.transitions[-1].reason == "4 steps completed"
    assert run.steps() == [1, 2, 3, 4] and run.sink.rows == result.records
    assert all(r["recoveries"] == 0 for r in result.records)
    assert [w["node_id"] for w in result.workers] == ["n1", "n2"]
    assert result.recoveries == [] and result.resizes == []
    # the pool (and spares) refilled once the group's first step is done, not before
    assert run.group.calls == [("start", 2), ("replenish", 0), ("shutdown",)]


def test_worker_failure_recovers_at_the_same_size():
    died = WorkerDied("rank 1's process died")
    run = make_run(
        {"n1": 1, "n2": 1}, ["elastic.max_failures=1"], faults=[Fault(0, 5, rank=1, error=died)]
    )
    result = run.controller.run()
    assert run.states() == [
        "SCHEDULING", "RUNNING", "RECOVERING", "SCHEDULING", "RUNNING", "FINISHED"
    ]  # fmt: skip
    (recovery,) = result.recoveries
    detected = recovery.pop("detected_at")
    assert detected == START + 6 * POLL_S  # the wait after step 5 reported the error
    last_step_at, phases = recovery.pop("last_step_at"), recovery.pop("phases")
    assert last_step_at == result.records[4]["time"]  # step 5's end
    assert phases["detect"] == detected - last_step_at
    assert phases["first_step"] == result.records[5]["step_time_s"]
    assert sum(phases.values()) == detected - last_step_at + recovery["first_step_after_s"]
    assert recovery.pop("running_at") == detected + recovery["decided_s"] + recovery["reform_s"]
    assert recovery == {
        "kind": "failure",
        "failure": 1,
        "reason": "worker rank 1 (node 10.0.0.2, pid 1001) raised WorkerDied",
        "last_step": 5,
        "decided_s": 0.0,
        "decision": "restart",
        "world_size": 2,
        "reform_s": 0.0,
        "restore_s": 0.5,
        "restored_from": "memory",
        "restored_step": 4,
        "restore_phases": {"fetch_s": 0.5},
        "restore_bytes": {"read": 3000, "held": 1000},
        "steps_redone": 1,
        "first_step_after_s": POLL_S,
    }
    assert run.steps() == [1, 2, 3, 4, 5, 5, 6, 7, 8]  # step 5 redone from the step-4 checkpoint
    assert [r["recoveries"] for r in result.records] == [0] * 5 + [1] * 4
    assert ("gather_evidence", []) in run.group.calls  # survivors were considered first
    assert ("replenish", 0) in run.group.calls  # after the first step, off the path
    assert result.world_size_history == [
        {"step": 0, "world_size": 2},
        {"step": 5, "world_size": 2},
    ]


def test_a_rank_lost_after_the_last_step_ends_the_run_finished_not_recovered():
    """Rank 0 returned from the last step (and the final checkpoint) when rank 1's node
    went: nothing is left to train, and the finished ranks let their state go, so a
    re-formed group would start over from step 0."""
    died = WorkerDied("rank 1's node was removed")
    run = make_run({"n1": 1, "n2": 1}, max_steps=4, faults=[Fault(0, 4, rank=1, error=died)])
    result = run.controller.run()
    assert run.states() == ["SCHEDULING", "RUNNING", "FINISHED"]
    assert result.transitions[-1].reason == (
        "4 steps completed; rank 1 (WorkerDied) was lost after the last step"
    )
    assert result.recoveries == [] and run.steps() == [1, 2, 3, 4]
    assert [r.rank for r in result.worker_results] == [0]


def test_failure_with_survivors_reforms_in_place():
    died = WorkerDied("gone")
    run = make_run(
        {"n1": 1, "n2": 1}, ["elastic.max_failures=1"], faults=[Fault(0, 3, rank=1, error=died)]
    )
    run.group.evidence = Evidence(2, healthy=[0], fates={1: Fate.PROCESS_DIED})
    result = run.controller.run()
    (recovery,) = result.recoveries
    assert recovery["lost"] == [{"rank": 1, "fate": "process_died"}]
    assert any("lost rank 1 (process_died)" in t.reason for t in result.transitions)
    assert recovery["decision"] == Action.REPLACE == "replace"
    assert recovery["world_size"] == 2
    assert recovery["reformed"] == {"kept": 1, "spares_used": 0, "started": 1}
    assert recovery["restored_step"] == 3 and recovery["steps_redone"] == 0
    starts = [c for c in run.group.calls if c[0] in ("start", "reform", "shutdown")]
    assert starts == [("start", 2), ("reform", [0], 2), ("shutdown",)]  # no restart between


def test_reports_a_dead_rank_0_made_unread_are_recorded_once_when_handed_over_again():
    """Rank 0 dies after step 5, its report of step 5 never read; the new group resumes
    from the survivor's state at step 5, and its rank 0 hands steps 3-5 over again before
    its first: 3 and 4 were recorded already and are dropped, 5 is recorded, once."""
    run = make_run(
        {"n1": 1, "n2": 1},
        ["elastic.max_failures=1"],
        faults=[Fault(0, 5, rank=0, error=WorkerDied("gone"))],
    )
    run.group.evidence = Evidence(2, healthy=[1], fates={0: Fate.PROCESS_DIED})
    run.group.at_step[5] = lambda: run.group.pending.clear()  # died with rank 0's process
    run.group.replays[1] = [3, 4, 5]
    result = run.controller.run()
    assert run.steps() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["step"] for r in result.records if r.get("replayed")] == [5]
    (recovery,) = result.recoveries
    assert recovery["restored_step"] == 5 and recovery["steps_redone"] == 0


def test_node_loss_with_survivors_shrinks_in_place_then_grows_back_in_place():
    """Rank 2's node dies: the survivors re-form at 2 without a restart; when a spare in
    the lost node's slot is warm, every rank pauses at a step boundary and it joins."""
    died = WorkerDied("node lost")
    run = make_run(
        {"n1": 1, "n2": 1, "n3": 1},
        ["elastic.max_failures=1", "scaling.num_workers=3", "scaling.min_workers=2"]
        + ["data.global_batch_size=12", "data.micro_batch_size=2"],
        faults=[Fault(0, 3, rank=2, error=died)],
        max_steps=10,
    )
    run.group.evidence = Evidence(3, healthy=[0, 1], fates={2: Fate.NODE_DIED})
    run.group.at_step[5] = lambda: setattr(run.group, "spares_ready", 1)
    result = run.controller.run()
    (recovery,) = result.recoveries
    assert recovery["decision"] == Action.SHRINK == "shrink"
    assert recovery["world_size"] == 2 and recovery["steps_redone"] == 0
    (resize,) = result.resizes
    assert resize["in_place"] and (resize["from"], resize["to"]) == (2, 3)
    assert resize["pause_s"] == pytest.approx(2 * POLL_S)  # the pause poll, then the step
    starts = [c for c in run.group.calls if c[0] in ("start", "reform", "shutdown", "pause")]
    assert starts == [
        ("start", 3), ("reform", [0, 1], 2), ("pause",), ("reform", [0, 1], 3), ("shutdown",)
    ]  # fmt: skip
    assert [h["world_size"] for h in result.world_size_history] == [3, 2, 3]
    assert run.steps() == list(range(1, 11))  # nothing redone, nothing skipped
    assert result.state is RunState.FINISHED


def test_in_place_plan_is_sized_by_the_scaling_policy():
    policy = ScalingPolicy(min_workers=2, max_workers=4, unit=2)
    plan = InPlacePlan(keep=[0, 1, 3], refill=[], left_out=[2])
    assert sized(plan, policy) == InPlacePlan([0, 1], [], [2], size=2, from_size=4)  # units
    spare = InPlacePlan(keep=[0, 1, 3], refill=[], left_out=[2], spares=1)
    assert sized(spare, policy).size == 4 and not sized(spare, policy).shrinks
    refill = InPlacePlan(keep=[0], refill=[1, 2, 3], left_out=[])
    assert sized(refill, policy).refill == [1, 2, 3] and sized(refill, policy).size == 4
    assert sized(InPlacePlan(keep=[0], refill=[], left_out=[1, 2, 3]), policy) is None
    background = InPlacePlan(keep=[0, 1], refill=[], left_out=[], deferred=[2, 3])
    assert sized(background, policy) == InPlacePlan([0, 1], [], [], [2, 3], size=2, from_size=4)
    wait = InPlacePlan(keep=[0], refill=[], left_out=[], deferred=[1])  # below min: wait
    assert sized(wait, policy) == InPlacePlan([0], [1], [], [], size=2, from_size=2)


def test_node_loss_shrinks_within_min_workers():
    died = WorkerDied("node lost")
    run = make_run(
        {"n1": 1, "n2": 1},
        ["scaling.min_workers=1", "scaling.max_workers=2", "elastic.max_failures=1"],
        faults=[Fault(0, 5, rank=1, error=died, lose_node=True)],
    )
    result = run.controller.run()
    assert result.state is RunState.FINISHED
    (recovery,) = result.recoveries
    assert recovery["decision"] == "restart" and recovery["world_size"] == 1
    assert recovery["decided_s"] > 4.0  # capacity settled for settle_s: max_workers never fit
    assert result.world_size_history == [
        {"step": 0, "world_size": 2},
        {"step": 5, "world_size": 1},
    ]
    assert result.transitions[2].reason == "1 workers fit; using 1 (min 1, max 2)"
    assert [w["node_id"] for w in result.workers] == ["n1"]
    assert run.steps()[-1] == 8 and result.resizes == []  # n2 never came back: no growing


def test_no_capacity_below_min_workers_fails_after_waiting():
    died = WorkerDied("node lost")
    run = make_run(
        {"n1": 1, "n2": 1},
        ["elastic.max_failures=1", "elastic.wait_for_capacity_s=10"],
        faults=[Fault(0, 5, rank=1, error=died, lose_node=True)],
    )
    with pytest.raises(TrainingFailed) as info:
        run.controller.run()
    assert str(info.value) == (
        "training failed: only 1 workers fit, fewer than scaling.min_workers=2: node lost"
    )
    assert info.value.__cause__ is died
    result = run.controller.result
    assert run.states() == ["SCHEDULING", "RUNNING", "RECOVERING", "FAILED"]
    (recovery,) = result.recoveries
    assert recovery["decision"] == "fail" and recovery["world_size"] is None
    assert recovery["decided_s"] >= 10.0  # waited elastic.wait_for_capacity_s for nodes
    assert "restored_step" not in recovery  # never got to a first step after
    assert run.group.calls[-1] == ("shutdown",)


def test_failure_budget_spent_fails_without_recovering():
    run = make_run(
        {"n1": 1, "n2": 1},
        ["elastic.max_failures=0"],
        faults=[Fault(0, 2, rank=0, error=WorkerDied("x"))],
    )
    with pytest.raises(TrainingFailed, match=r"worker rank 0 .* raised WorkerDied: x"):
        run.controller.run()
    assert run.states() == ["SCHEDULING", "RUNNING", "FAILED"]
    assert run.controller.result.recoveries == []


def test_non_finite_loss_is_not_retried():
    nan = NonFiniteLossError("non-finite step 3")
    run = make_run(
        {"n1": 1, "n2": 1}, ["elastic.max_failures=5"], faults=[Fault(0, 2, 0, nan, dead=False)]
    )
    with pytest.raises(TrainingFailed, match="raised NonFiniteLossError: non-finite step 3"):
        run.controller.run()
    assert run.states() == ["SCHEDULING", "RUNNING", "FAILED"]
    assert run.controller.recoveries.failures == 0


def test_grows_back_when_capacity_returns():
    run = make_run(
        {"n1": 1},
        [
            "scaling.min_workers=1",
            "scaling.max_workers=2",
            "elastic.grow_check_s=0.5",
            "elastic.grow_stable_s=1",
            "elastic.resize_cooldown_s=2",
        ],
        max_steps=16,
    )
    run.group.at_step[3] = lambda: run.cluster.slots.update(n2=1)  # a node joins
    result = run.controller.run()
    assert run.states() == [
        "SCHEDULING", "RUNNING", "RESIZING", "SCHEDULING", "RUNNING", "FINISHED"
    ]  # fmt: skip
    (preempt,) = [c for c in run.group.calls if c[0] == "preempt"]
    assert preempt == ("preempt", [0], 30.0)  # a checkpoint boundary on rank 0
    # checks every 0.5 s: n2 seen at t=0.75 s, stable at 1.75 s, past the cooldown (2 s since
    # the group formed) at the check of 2.25 s, after step 9; rank 0 stops at that step
    (resize,) = result.resizes
    phases = resize.pop("phases")  # the pause, split (records.RESIZE_PHASES)
    assert sum(phases.values()) == pytest.approx(resize["pause_s"])
    assert {k: v for k, v in phases.items() if v} == {"pause": 0.25, "first_step": 0.25}
    assert resize == {
        "step": 9, "from": 1, "to": 2, "wanted": 2, "decided_s": 0.0, "in_place": False,
        "pause_s": 0.5, "state_from": "memory", "reform_s": 0.0,
        "restore_bytes": {"read": 3000, "held": 1000}, "restore_phases": {"fetch_s": 0.5},
    }  # fmt: skip
    assert result.transitions[1].reason == "checkpoint at step 9 committed; growing to 2 workers"
    assert result.world_size_history[-1] == {"step": 9, "world_size": 2}
    assert run.steps() == list(range(1, 17))  # nothing redone
    assert result.recoveries == []


def test_drain_notice_preempts_and_shrinks_away_from_the_node():
    run = make_run(
        {"n1": 1, "n2": 1}, ["scaling.min_workers=1", "scaling.max_workers=2"], max_steps=10
    )
    run.group.at_step[3] = lambda: run.cluster.draining.update(n2=20.0)
    result = run.controller.run()
    assert run.states() == [
        "SCHEDULING", "RUNNING", "RECOVERING", "SCHEDULING", "RUNNING", "FINISHED"
    ]  # fmt: skip
    assert ("preempt", [1], 20.0) in run.group.calls  # n2's rank, within the drain deadline
    (recovery,) = result.recoveries
    assert recovery["kind"] == "preemption" and recovery["failure"] == 0
    # drains are read once a second: at t=0.25 s, then after step 5 (t=1.25 s)
    assert recovery["reason"] == (
        "preemption notice (SIGTERM or node drain) for node(s) 10.0.0.2; "
        "emergency checkpoint at step 5"
    )
    assert recovery["last_step"] == 5 and recovery["steps_redone"] == 0
    assert recovery["world_size"] == 1 and run.group.avoid_nodes == {"n2"}
    assert [w["node_id"] for w in result.workers] == ["n1"]
    assert run.controller.recoveries.preemptions == 1


def test_preemption_below_min_workers_stops_preempted():
    run = make_run({"n1": 1, "n2": 1}, max_steps=10)
    run.group.at_step[3] = lambda: run.cluster.draining.update(n2=20.0)
    result = run.controller.run()  # PREEMPTED is not an error: the checkpoint is committed
    assert result.state is RunState.PREEMPTED
    assert run.states() == ["SCHEDULING", "RUNNING", "RECOVERING", "PREEMPTED"]
    assert result.transitions[-1].reason.endswith("checkpoint is committed: rerun to resume")
    assert result.recoveries[0]["decision"] == "fail"


def test_hang_names_the_rank_dumps_stacks_and_recovers():
    run = make_run(
        {"n1": 1, "n2": 1},
        ["elastic.max_failures=1", "elastic.hang_floor_s=2", "elastic.hang_factor=1"],
        faults=[Fault(0, 3, rank=1, dead=False)],
    )
    result = run.controller.run()
    (recovery,) = result.recoveries
    assert recovery["reason"].startswith("hang: rank 1 (node 10.0.0.2, pid 1001) made no progress")
    assert recovery["last_step"] == 3 and recovery["world_size"] == 2
    assert ("dump_stacks", 0) in run.group.calls
    assert ("gather_evidence", [1]) in run.group.calls  # the hung rank is not kept
    assert result.state is RunState.FINISHED


def test_stop_from_another_thread_ends_in_failed_with_every_step_made_recorded():
    """A stop ends the run FAILED, and rank 0's records made since the last poll are
    forwarded first: a step it finished may have committed its checkpoint, and the next
    fit() resumes after it."""
    run = make_run({"n1": 1, "n2": 1}, ["elastic.poll_interval_s=60"])  # no poll before it
    run.group.at_step[2] = lambda: run.controller.stop("user pressed stop")
    with pytest.raises(TrainingFailed, match="stopped: user pressed stop"):
        run.controller.run()
    assert run.states() == ["SCHEDULING", "RUNNING", "FAILED"]
    assert run.group.calls[-1] == ("shutdown",)
    assert run.group.step >= 2 and not run.group.pending
    assert [r["step"] for r in run.controller.result.records] == list(range(1, run.group.step + 1))


def test_an_interrupt_checkpoints_at_the_next_boundary_and_ends_interrupted():
    """Ctrl-C (``interrupt``, as from a signal handler): rank 0 is asked for the emergency
    checkpoint, the run ends INTERRUPTED at that step, not FAILED, and nothing is raised."""
    run = make_run({"n1": 1, "n2": 1})
    run.group.at_step[2] = lambda: run.controller.interrupt("Ctrl-C")
    result = run.controller.run()
    assert run.states() == ["SCHEDULING", "RUNNING", "INTERRUPTED"]
    stopped = result.worker_results[0].preempted_at
    assert 2 <= stopped < 8 and ("preempt", [0], 30.0) in run.group.calls  # preemption_grace_s
    assert result.transitions[-1].reason == (
        f"interrupted (Ctrl-C): checkpoint at step {stopped} committed; rerun the same "
        "command to resume"
    )


def test_start_marks_are_the_first_groups_and_its_first_records():
    """The run's start is the group that made the first step: a later re-form (here in
    place, after a failure) leaves the marks as they were."""
    died = WorkerDied("rank 1's process died")
    run = make_run(
        {"n1": 1, "n2": 1}, ["elastic.max_failures=1"], faults=[Fault(0, 3, rank=1, error=died)]
    )
    run.group.evidence = Evidence(2, healthy=[0], fates={1: Fate.PROCESS_DIED})
    result = run.controller.run()
    assert ("reform", [0], 2) in run.group.calls
    first = result.records[0]
    assert set(result.start_marks) == {"placed_at", "formed_at", "built_at"}
    assert result.start_marks["built_at"] == first["time"] - first["step_time_s"]
    assert result.start_marks["placed_at"] <= result.start_marks["formed_at"] <= first["time"]


def test_recovery_record_keys_appear_stage_by_stage():
    recovery = Recovery(RecoveryKind.FAILURE, 1, "r", 10.0, 7)
    opened = ["kind", "failure", "reason", "detected_at", "last_step"]
    assert list(recovery.to_dict()) == opened
    recovery.decide(12.5, Action.RESTART, 3)
    decided = recovery.to_dict()
    assert list(decided) == opened + ["decided_s", "decision", "world_size"]
    assert decided["decided_s"] == 2.5 and type(decided["decision"]) is str
    recovery.account(StepReport(8, 20.0, 0.0, 1.0))  # started afresh: nothing restored
    accounted = recovery.to_dict()
    assert accounted["restored_step"] == 0 and accounted["steps_redone"] == 7
    assert accounted["restored_from"] is None and accounted["first_step_after_s"] == 10.0
    assert "reformed" not in accounted


def test_by_default_a_failure_is_recovered_and_the_log_line_states_the_budget():
    """elastic.max_failures defaults to a bounded budget: the first killed worker is
    recovered, and the RUNNING -> RECOVERING line says how much of it is spent."""
    run = make_run({"n1": 1, "n2": 1}, faults=[Fault(0, 2, rank=0, error=WorkerDied("x"))])
    result = run.controller.run()
    assert run.states()[:3] == ["SCHEDULING", "RUNNING", "RECOVERING"]
    assert run.states()[-1] == "FINISHED" and result.records[-1]["step"] == 8
    to_recovering = [t for t in result.transitions if t.target == "RECOVERING"]
    assert len(to_recovering) == 1 and to_recovering[0].reason.endswith(
        "raised WorkerDied; failure 1 of 3 allowed (elastic.max_failures)"
    )
