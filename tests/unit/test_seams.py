"""The seams that carry a new strategy, tier or model family: capabilities declared on the
interface, read through registries, never decided by comparing names elsewhere.

Unit rung: an ast scan of the package, then one test double of each kind, registered by
one line, which the code that reads the seam serves without knowing its name.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

import pytest
import torch

from raytrain_ext.checkpoint.fetch import StepLoad, fetch_step
from raytrain_ext.checkpoint.manifest import Manifest, checksum_file
from raytrain_ext.checkpoint.phases import RestorePhases
from raytrain_ext.checkpoint.restore import load_planned
from raytrain_ext.checkpoint.tiers.base import FetchMode, Tier, prune
from raytrain_ext.models import model_spec
from raytrain_ext.models.sources import MODEL_SOURCES, ModelSourceHooks
from raytrain_ext.parallel import catalog
from raytrain_ext.parallel.catalog import LiveState, StrategyCapabilities
from raytrain_ext.parallel.dims import (
    ParallelLayoutError,
    check_pipeline,
    check_strategy_support,
    restores_own_shards,
    shards_from_replicas,
    state_from_peers,
)
from raytrain_ext.parallel.registry import build_strategy
from tests.helpers.toy import TOY_SPEC, PlainStrategy

PACKAGE = Path(__file__).resolve().parents[2] / "raytrain_ext"
REGISTRIES = {
    "parallel/catalog.py",  # strategies
    "checkpoint/tiers/__init__.py",  # tiers
    "models/sources.py",  # model sources
}
NAMED_CHOICES = {"strategy", "source"}  # parallel.strategy, model.source
NAMED_PARTS = {"tier", "inner"}  # tier.name, a pipeline's inner strategy's name


def _spelled(node: ast.expr) -> str:
    """The last name of an expression: ``cfg.parallel.strategy`` -> ``strategy``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _names_a_choice(node: ast.expr) -> bool:
    """``x.strategy``, ``x.source``, a local ``strategy``, ``tier.name``, ``inner.name``."""
    if isinstance(node, ast.Attribute) and node.attr in NAMED_CHOICES:
        return True
    if isinstance(node, ast.Name) and node.id == "strategy":
        return True
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "name"
        and _spelled(node.value) in NAMED_PARTS
    )


def name_checks(source: str, where: str) -> List[str]:
    """``strategy == ...``, ``x.source != ...``, ``tier.name == ...``, ``inner.name ==``,
    ``isinstance(t, SomeTier)``: a capability decided by a name outside its registry."""
    found = []
    for node in ast.walk(ast.parse(source)):
        sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        against_none = any(isinstance(s, ast.Constant) and s.value is None for s in sides)
        if any(_names_a_choice(side) for side in sides) and not against_none:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and _spelled(node.func) == "isinstance":
            kinds = node.args[1] if len(node.args) == 2 else None
            names = [_spelled(k) for k in (kinds.elts if isinstance(kinds, ast.Tuple) else [kinds])]
            if any(name.endswith("Tier") for name in names if name):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_each_kind_of_name_check():
    code = (
        "a = cfg.parallel.strategy == 'fsdp'\n"
        "b = strategy not in ('ddp',)\n"
        "c = tier.name == 'memory'\n"
        "d = self.inner.name == 'fsdp'\n"
        "e = isinstance(tier, (DiskTier, S3Tier))\n"
        "f = cfg.model.source != ModelSource.hf\n"
        "ok = caps.tensor_parallel and tier.holds_snapshots and isinstance(x, int)\n"
        "ok = cfg.model.source is None or t['source'] == source\n"
    )
    assert [hit.split(":")[1] for hit in name_checks(code, "x")] == list("123456")


def test_no_capability_is_decided_by_a_name_outside_the_registries():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where not in REGISTRIES:
            found += name_checks(path.read_text(), where)
    assert found == [], "declare the capability on the interface instead:\n" + "\n".join(found)


# ---- a strategy: one class plus one catalog line ---------------------------------------------
class EchoStrategy(PlainStrategy):
    """A test double: PlainStrategy under a name the package has never seen."""

    name = "echo"

    def __init__(self, parallel_cfg=None, spec=TOY_SPEC):
        super().__init__()
        self.cfg = parallel_cfg


ECHO = StrategyCapabilities(
    label="Echo",
    implementation=f"{__name__}:EchoStrategy",
    tensor_parallel=True,
    replica_groups=True,
    live_state=LiveState.own_shards,
)


def _parallel(strategy: str, **degrees) -> SimpleNamespace:
    layout = dict(tp=1, pp=1, ep=1, dp_replicate=1, dp_shard=-1)
    options = dict(activation_checkpointing=False, cpu_offload=False, compile=False)
    return SimpleNamespace(strategy=strategy, **{**layout, **options, **degrees})


def test_a_new_strategy_is_served_by_its_catalog_line_alone(monkeypatch):
    monkeypatch.setitem(catalog.STRATEGY_CATALOG, "echo", ECHO)
    check_strategy_support(_parallel("echo", tp=2, dp_replicate=2))  # declared: accepted
    with pytest.raises(ParallelLayoutError, match=r"parallel.strategy=fsdp or echo"):
        check_strategy_support(_parallel("ddp", tp=2))  # the fix offered names the double
    with pytest.raises(ParallelLayoutError, match=r"runs with parallel.strategy ddp or fsdp"):
        check_pipeline(_parallel("echo", pp=2), SimpleNamespace(n_layers=2))
    strategy = build_strategy(_parallel("echo"), TOY_SPEC)
    assert isinstance(strategy, EchoStrategy)
    peers = SimpleNamespace(state_from_peers=True)
    hsdp = SimpleNamespace(parallel=_parallel("echo", dp_replicate=2), elastic=peers)
    assert shards_from_replicas(hsdp) and restores_own_shards(hsdp)
    assert not state_from_peers(hsdp)


# ---- a tier: one class plus one line in build_tiers ------------------------------------------
class DictTier(Tier):
    """A test double: committed steps held in a dict, read back as views, keeping one step."""

    name = "dict"
    holds_snapshots = True
    fetch_mode = FetchMode.views

    def __init__(self):
        self.files: Dict[int, Dict[str, bytes]] = {}
        self.manifests: Dict[int, str] = {}

    def probe(self) -> None:
        pass

    def upload(self, step: int, src_dir: Path, names: List[str]) -> None:
        self.files.setdefault(step, {}).update({n: (src_dir / n).read_bytes() for n in names})

    def commit(self, manifest: Manifest) -> None:
        self.manifests[manifest.step] = manifest.to_json()

    def committed_steps(self) -> List[int]:
        return sorted(self.manifests)

    def manifest_text(self, step: int) -> Optional[str]:
        return self.manifests.get(step)

    def materialize(self, step: int, names: List[str], cache_dir: Path) -> Path:
        raise AssertionError("a views tier is never materialised by a restore")

    def read_files(self, step: int, names: List[str]) -> Dict[str, memoryview]:
        return {name: memoryview(self.files[step][name]) for name in names}

    def all_steps(self) -> List[int]:
        return sorted(self.files)

    def delete(self, step: int) -> None:
        self.files.pop(step, None)
        self.manifests.pop(step, None)

    def kept_steps(self, ckpt_cfg) -> int:
        return 1


def _save(tier: Tier, directory: Path, step: int) -> Dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    saved = {"w": torch.randn(16, 8) + step, "b": torch.arange(5.0) * step}
    dcp.save(saved, checkpoint_id=directory, no_dist=True)
    names = sorted(p.name for p in directory.iterdir())
    files = {n: checksum_file(directory / n, chunk_size=256) for n in names}
    tier.upload(step, directory, names)
    tier.commit(Manifest(step=step, world_size=1, tier=tier.name, files=files))
    return saved


def test_a_new_tier_is_restored_from_and_retained_by_what_it_declares(tmp_path):
    tier = DictTier()
    for step in (3, 6):
        saved = _save(tier, tmp_path / f"save-{step}", step)
    manifest = Manifest.from_json(tier.manifest_text(6))
    targets = {"w": torch.zeros(16, 8), "b": torch.zeros(5)}
    load = StepLoad(
        6, manifest, targets, RestorePhases(), tmp_path / "cache", True, lambda *a: None, 2
    )
    fetched = fetch_step(tier, load)
    assert fetched.problem is None
    assert load_planned(targets, fetched.reader, fetched.planner) is None
    assert all(torch.equal(targets[k], saved[k]) for k in saved)
    assert prune(tier, tier.kept_steps(None)) == [3] and tier.committed_steps() == [6]


# ---- a model family: one hooks class plus one MODEL_SOURCES line -----------------------------
class ToySource(ModelSourceHooks):
    """A test double: the toy model's spec, a tokenizer of its own, no per-document attention."""

    name = "toy"
    label = "the toy model"
    per_document_attention = False

    def default_tokenizer(self, model_cfg) -> Optional[str]:
        return "toy-tokenizer"

    def spec(self, model_cfg, model_factory=None):
        return TOY_SPEC


def test_a_new_model_source_is_served_by_its_registry_line_alone(monkeypatch):
    from raytrain_ext.data.open import tokenizer_spec
    from raytrain_ext.errors import InputError
    from raytrain_ext.inputs.text_data_check import check_document_mask

    monkeypatch.setitem(MODEL_SOURCES, "toy", ToySource())
    model = SimpleNamespace(source="toy")
    assert model_spec(model) is TOY_SPEC
    cfg = SimpleNamespace(model=model, data=SimpleNamespace(tokenizer=None))
    assert tokenizer_spec(cfg) == "toy-tokenizer"
    data = SimpleNamespace(document_mask=True, format="text")
    with pytest.raises(InputError, match="the toy model has no per-document attention"):
        check_document_mask(SimpleNamespace(model=model, data=data))
