"""How a lost worker died, decided from Ray's records (``elastic.death.verdict``): pure,
no Ray.  The same rules meet real deaths in tests/cluster/test_death_evidence.py."""

import pytest

from raytrain_ext.ray_group.death import Fate, verdict


@pytest.mark.parametrize(
    "state, cause, node_alive, answered, fate",
    [
        ("DEAD", "WORKER_DIED", True, False, Fate.PROCESS_DIED),
        ("DEAD", "RAY_KILL", True, False, Fate.PROCESS_DIED),
        ("DEAD", "OOM", True, False, Fate.PROCESS_DIED),
        ("DEAD", "WORKER_DIED", False, False, Fate.NODE_DIED),  # the node died after all
        ("DEAD", "NODE_DIED", True, False, Fate.NODE_DIED),
        ("ALIVE", None, False, True, Fate.NODE_DIED),  # a dead node outranks an answer
        ("ALIVE", None, True, True, Fate.ALIVE),
        ("ALIVE", None, True, False, None),  # a live-looking node proves nothing
        ("DEAD", "WORKER_DIED", None, False, None),  # the node is not listed
        ("DEAD", "UNSPECIFIED", True, False, None),
        ("RESTARTING", None, True, False, None),
        (None, None, True, False, None),
    ],
)
def test_verdict(state, cause, node_alive, answered, fate):
    assert verdict(state, cause, node_alive, answered) == fate
