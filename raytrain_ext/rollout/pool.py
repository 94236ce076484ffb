"""Rollout engines as Ray actors, and what happens when one dies.

:class:`EnginePool` spreads a step's prompt groups over its engines in whole generate calls
(``RolloutSettings.groups_per_call`` consecutive groups each, never a part of one) and
gathers their completions in request order.  When an engine dies (its
process killed, its node lost), the groups it had not returned are issued again, whole,
to the engines still alive, and a replacement takes the lost engine's place and the
weights the others have (a warm spare when the pool keeps one, ``spares``: its process
started and its model built before the loss, and a new spare then starts off the step's
path; else a new engine): the pool keeps a reference to the newest weights, the
trainers' own, which the rollout service holds in Ray's object store (no checkpoint is
read, no file written).  Because every completion is drawn from its
own seed (``rollout.sampling``), what the re-issued groups generate is what the lost
engine would have generated.

Each loss is recorded (``EngineRecovery``: engine, Ray's verdict, groups re-issued,
seconds from the loss to the step's last completion).

Invariants:
- ``generate`` returns one ``GroupCompletions`` per request, in request order, each from
  exactly one engine call: none missing, none twice, never a partial group.
- A replacement generates only after it has loaded the pool's newest weights.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
import torch

from raytrain_ext.ray_group.death import fates_of
from raytrain_ext.rollout.engine import (
    GroupCompletions,
    GroupRequest,
    HFGenerateEngine,
    RolloutEngine,
    RolloutSettings,
)
from raytrain_ext.rollout.weights_wire import WireState, from_wire

log = logging.getLogger(__name__)

ModelFactory = Callable[[], torch.nn.Module]
# another backend's engine, from the settings and the reference policy (None: no KL term)
EngineBuilder = Callable[[RolloutSettings, Optional[torch.nn.Module]], RolloutEngine]
SPARE_ANSWER_S = 1.0  # a spare that does not answer within this is taken for lost
FATE_WAIT_S = 10.0  # the longest wait for Ray's verdict on a lost engine (its groups are
# issued again before it is asked)


class EngineActor:
    """One engine in a Ray actor: ``HFGenerateEngine`` over the model ``build`` makes, or
    what ``backend`` builds (``rollout.backend=vllm``); scoring its completions under the
    model ``reference`` makes, when given."""

    def __init__(
        self,
        build: ModelFactory,
        settings: RolloutSettings,
        reference: Optional[ModelFactory] = None,
        backend: Optional[EngineBuilder] = None,
    ):
        scorer = None if reference is None else reference()
        self.engine: RolloutEngine = (
            HFGenerateEngine(build(), settings, scorer)
            if backend is None
            else backend(settings, scorer)
        )

    def load_weights(self, wire: WireState, version: int) -> int:
        self.engine.load_weights(from_wire(wire), version)
        return version

    def generate(self, requests: Sequence[GroupRequest]) -> List[GroupCompletions]:
        return self.engine.generate(requests)

    def placement(self) -> Tuple[str, int]:
        """(node id, pid) of this engine."""
        return ray.get_runtime_context().get_node_id(), os.getpid()


@dataclass
class EngineRecovery:
    """One engine lost: which, Ray's verdict ("pending" until Ray gives it, off the step's
    path), the groups issued again, the seconds from noticing the loss to the step's
    last completion, and whether a warm spare took its place."""

    engine: int
    fate: str
    groups_reissued: int
    seconds: float
    from_spare: bool = False

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class EnginePool:
    """``engines`` rollout engines, each an actor of ``actor_options`` (resources,
    scheduling) building its model with ``build`` (and the reference policy with
    ``reference``, for GRPO's KL term); ``timeout_s`` bounds every wait on one."""

    def __init__(
        self,
        build: ModelFactory,
        settings: RolloutSettings,
        engines: int,
        actor_options: Optional[Dict[str, Any]] = None,
        timeout_s: float = 600.0,
        reference: Optional[ModelFactory] = None,
        backend: Optional[EngineBuilder] = None,
        spares: int = 0,
    ):
        if engines < 1 or spares < 0:
            raise ValueError(
                f"a rollout needs at least one engine and no negative number of spares; got "
                f"{engines} engine(s) and {spares} spare(s)"
            )
        self._remote = ray.remote(EngineActor).options(max_restarts=0, **(actor_options or {}))
        self._build, self._settings, self.timeout_s = build, settings, timeout_s
        self._reference, self._backend = reference, backend
        self.actors: List[Any] = []
        self._placements: List[ray.ObjectRef] = []  # each engine's (node id, pid), once built
        for _ in range(engines):
            self.actors.append(self._new_actor())
            self._placements.append(self.actors[-1].placement.remote())
        ray.get(self._placements, timeout=timeout_s)  # built: a model that fails, fails here
        self.spares: List[Tuple[Any, ray.ObjectRef]] = []  # (actor, its placement), oldest first
        for _ in range(spares):  # after the engines: they build first
            self._start_spare()
        self._weights: Optional[Tuple[ray.ObjectRef, int]] = None
        self.recoveries: List[EngineRecovery] = []
        self._closed = False

    def _new_actor(self) -> Any:
        return self._remote.remote(self._build, self._settings, self._reference, self._backend)

    def _start_spare(self) -> None:
        actor = self._new_actor()
        self.spares.append((actor, actor.placement.remote()))

    def _replace(self, engine: int) -> bool:
        """A new engine in ``engine``'s place: the oldest live spare whose model is built
        (a new spare starts in its place), else a new actor; whether a spare took it."""
        if self._closed:
            raise RuntimeError("the rollout engines were shut down")
        spare = self._live_spare()
        if spare is None:
            actor = self._new_actor()
            self.actors[engine], self._placements[engine] = actor, actor.placement.remote()
            return False
        self.spares.remove(spare)
        self.actors[engine], self._placements[engine] = spare
        self._start_spare()
        return True

    def _live_spare(self) -> Optional[Tuple[Any, ray.ObjectRef]]:
        """The oldest spare whose model is built and whose process answers now; a spare
        that died idle (its node lost, its process killed) is dropped and another started."""
        built = ray.wait([p for _, p in self.spares], num_returns=len(self.spares), timeout=0)[0]
        for spare in [s for s in self.spares if s[1] in built]:
            actor, placement = spare
            try:
                ray.get(placement, timeout=0)  # raises when it died before it was built
                ray.get(actor.placement.remote(), timeout=SPARE_ANSWER_S)
                return spare
            except (ray.exceptions.RayError, TimeoutError):
                self.spares.remove(spare)
                ray.kill(actor, no_restart=True)
                self._start_spare()
        return None

    def load_weights(self, weights: ray.ObjectRef, version: int) -> None:
        """Every engine takes ``weights`` (a ``WireState`` in the object store, put by the
        caller, who owns it; each engine reads it in place) before its next ``generate``:
        Ray runs an actor's calls in the order they were submitted, so nothing here waits
        for an engine (a replacement still building its model, a lost one whose verdict
        takes seconds).  A lost engine is found, replaced and recorded by the next
        ``generate``."""
        self._weights = (weights, version)
        for actor in self.actors:
            actor.load_weights.remote(weights, version)

    def generate(self, requests: Sequence[GroupRequest]) -> List[GroupCompletions]:
        """Every request's group, whole, in request order, through engine losses (an
        engine that returns nothing within ``timeout_s`` is killed and counts as lost;
        more than two losses per engine in one call fail it)."""
        n = len(self.actors)
        pending: Dict[ray.ObjectRef, Tuple[int, Any, List[int]]] = {}
        per_call = self._settings.groups_per_call
        calls = [
            list(range(k, min(k + per_call, len(requests))))
            for k in range(0, len(requests), per_call)
        ]
        for engine in range(n):
            chunk = [i for call in calls[engine::n] for i in call]  # whole calls, in order
            if chunk:
                pending[self._submit(engine, requests, chunk)] = (
                    engine,
                    self.actors[engine],
                    chunk,
                )
        done: Dict[int, GroupCompletions] = {}
        lost: List[Tuple[float, EngineRecovery]] = []
        hung: List[Any] = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.timeout_s)
            if not ready:  # hung: killed, then lost as any other
                hung += [actor for _, actor, _ in pending.values()]
                for actor in hung:
                    ray.kill(actor, no_restart=True)
                continue
            engine, actor, chunk = pending.pop(ready[0])
            try:
                done.update(zip(chunk, ray.get(ready[0]), strict=True))
                continue
            except ray.exceptions.RayActorError:
                noticed = time.monotonic()
            if len(lost) >= 2 * n:
                raise RuntimeError(
                    f"rollout: {len(lost)} engine losses in one step; the engines cannot be "
                    "kept up (placement, or their model fails to build): see the engines' logs"
                )
            replaced = self._restart(engine) if self.actors[engine] is actor else None
            target = self._least_busy(engine, [(e, len(c)) for e, _, c in pending.values()])
            pending[self._submit(target, requests, chunk)] = (target, self.actors[target], chunk)
            if replaced is not None:  # Ray's verdict, off this path: the groups go on
                node, from_spare = replaced
                recovery = EngineRecovery(engine, "pending", len(chunk), 0.0, from_spare)
                self.recoveries.append(recovery)
                lost.append((noticed, recovery))
                threading.Thread(
                    target=self._verdict,
                    args=(recovery, actor, node, actor in hung),
                    name="engine-verdict",
                    daemon=True,
                ).start()
        finished = time.monotonic()
        for noticed, recovery in lost:
            recovery.seconds = finished - noticed
        return [done[i] for i in range(len(requests))]

    def _submit(
        self, engine: int, requests: Sequence[GroupRequest], chunk: List[int]
    ) -> ray.ObjectRef:
        return self.actors[engine].generate.remote([requests[i] for i in chunk])

    def _least_busy(self, lost: int, in_flight: List[Tuple[int, int]]) -> int:
        """The live engine with the fewest groups in flight (the lost one's replacement
        only when it is the pool's one engine: it may still have to build its model)."""
        load = {e: 0 for e in range(len(self.actors)) if e != lost}
        for engine, groups in in_flight:
            if engine in load:
                load[engine] += groups
        return min(load, key=lambda e: (load[e], e)) if load else lost

    def _restart(self, engine: int) -> Tuple[str, bool]:
        """A replacement in the lost engine's place (``_replace``), given the newest
        weights before anything else (Ray runs an actor's calls in submission order); the
        node the lost one ran on, and whether a spare took its place."""
        node = self._node_of(engine)
        from_spare = self._replace(engine)
        if self._weights is not None:
            ref, version = self._weights
            self.actors[engine].load_weights.remote(ref, version)
        return node, from_spare

    def _verdict(self, recovery: EngineRecovery, lost: Any, node: str, hung: bool) -> None:
        """Ray's verdict on a lost engine (``ray_group.death``) into its record, asked
        before it is killed for good (an unreachable one that comes back stays out);
        ``hung`` when this pool killed it for returning nothing.  On a thread of its own:
        the verdict may take seconds, and the step does not wait for it."""
        fate = "hung" if hung else fates_of([lost], [node], timeout_s=FATE_WAIT_S)[0].value
        ray.kill(lost, no_restart=True)
        recovery.fate = fate
        log.warning(
            "rollout engine %d lost (%s); %d group(s) issued again",
            recovery.engine,
            fate,
            recovery.groups_reissued,
        )

    def _node_of(self, engine: int) -> str:
        """The node a lost engine ran on ("" when it died before it was built)."""
        try:
            node, _ = ray.get(self._placements[engine], timeout=1.0)
        except (ray.exceptions.RayError, TimeoutError):
            return ""
        return node

    def known_placements(self) -> List[Tuple[str, int]]:
        """(node id, pid) of each engine built so far, waiting for none (("", 0): not yet)."""
        ready = set(ray.wait(self._placements, num_returns=len(self._placements), timeout=0)[0])
        known: List[Tuple[str, int]] = []
        for ref in self._placements:
            try:
                known.append(ray.get(ref) if ref in ready else ("", 0))
            except ray.exceptions.RayError:  # an engine that died before it was built
                known.append(("", 0))
        return known

    def placements(self) -> List[Tuple[str, int]]:
        """(node id, pid) of each engine, waiting for any still starting."""
        return ray.get(self._placements, timeout=self.timeout_s)

    def spare_placements(self) -> List[Tuple[str, int]]:
        """(node id, pid) of each spare, waiting for any still starting."""
        return ray.get([p for _, p in self.spares], timeout=self.timeout_s)

    def shutdown(self) -> None:
        self._closed = True
        for actor in [*self.actors, *(a for a, _ in self.spares)]:
            ray.kill(actor)
        self.actors, self.spares = [], []
