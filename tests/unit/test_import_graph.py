"""The package has no import cycle, counting imports inside functions (which hide one).

Unit rung: reads the source with ``ast``, imports nothing.  Imports under
``if TYPE_CHECKING:`` are left out: they never run.
"""

import ast
import functools
from pathlib import Path
from typing import Dict, List, Set

import pytest

from tests.helpers.imports import Probe

PACKAGE = Path(__file__).resolve().parents[2] / "raytrain_ext"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> Set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:``."""
    skipped: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    return skipped


def imported_modules(path: Path, known: Set[str]) -> Set[str]:
    """The package's modules that ``path`` imports, anywhere in the file."""
    tree = ast.parse(path.read_text())
    skipped, found = _type_checking_only(tree), set()
    here = module_name(path).split(".")
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            package = here if path.name == "__init__.py" else here[:-1]
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + [base]).strip(".")
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {name for name in found if name in known} - {module_name(path)}


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (a fresh copy of :func:`_parsed_graph`)."""
    return {name: set(imported) for name, imported in _parsed_graph().items()}


@functools.lru_cache(maxsize=1)
def _parsed_graph() -> Dict[str, Set[str]]:
    """Parsed once per session: every test of the graph read the whole package again (0.8 s
    each)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


# Folders (and top-level modules) that run inside a rank, and the driver's controller above
# them: nothing in the first imports the second.
WORKER_SIDE = ("worker", "train", "parallel", "models", "objectives", "checkpoint", "data")
DRIVER_CONTROL = ("elastic", "trainer", "cli", "tune")


def folder_of(module: str) -> str:
    """``raytrain_ext.data.open`` -> ``data``; a top-level module is its own unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def two_way_folder_pairs(graph: Dict[str, Set[str]]) -> List[str]:
    """Folders that import each other, each with one import of each direction."""
    edges: Dict[tuple, str] = {}
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            pair = (folder_of(module), folder_of(target))
            if pair[0] != pair[1]:
                edges.setdefault(pair, f"{module} -> {target}")
    return [
        f"{a} <-> {b}: {edges[(a, b)]}; {edges[(b, a)]}"
        for (a, b) in sorted(edges)
        if a < b and (b, a) in edges
    ]


def test_pair_finder_names_both_directions():
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": set(), "p.b.z": {"p.a.w"}, "p.a.w": set()}
    assert two_way_folder_pairs(graph) == ["a <-> b: p.a.x -> p.b.y; p.b.z -> p.a.w"]
    assert two_way_folder_pairs({"p.a.x": {"p.b.y"}, "p.b.y": set()}) == []


def test_no_two_folders_import_each_other():
    """Leaves (``errors``, ``storage``) sit under everything, so dependencies between the
    package's folders run one way (docs/architecture.md, import rules)."""
    found = two_way_folder_pairs(import_graph())
    assert found == [], "folders importing each other both ways:\n" + "\n".join(found)


def test_worker_code_never_imports_the_drivers_controller():
    graph = import_graph()
    back = [
        f"{module} -> {target}"
        for module, imported in sorted(graph.items())
        if folder_of(module) in WORKER_SIDE
        for target in sorted(imported)
        if folder_of(target) in DRIVER_CONTROL
    ]
    assert back == []


def test_operator_tools_are_imported_by_the_cli_only():
    """``ops/`` (doctor, plan, report) stands apart from what runs a training job."""
    graph = import_graph()
    users = sorted(
        module
        for module, imported in graph.items()
        if folder_of(module) != "ops" and any(folder_of(t) == "ops" for t in imported)
    )
    assert users == ["raytrain_ext.cli"]


def test_the_offline_data_pipeline_imports_only_leaves():
    """``prepare/`` (``data prepare``) stands on the leaves alone, not on the training side
    (its command connects to Ray the way every command does, ``ray_session``)."""
    graph = import_graph()
    reached = {
        folder_of(target)
        for module, imported in graph.items()
        if folder_of(module) == "prepare"
        for target in imported
    }
    assert reached <= {"prepare", "errors", "storage", "ray_session"}, reached


def imports_ray(path: Path) -> bool:
    """Whether ``path`` imports Ray (or a module of it), anywhere in the file."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import) and any(
            alias.name.split(".")[0] == "ray" for alias in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            return True
    return False


def test_the_controller_decides_without_ray():
    """``elastic/`` (the state machine, policies, the recovery decision) imports no Ray,
    directly or through the Ray-bound ``ray_group/``, which the trainer hands it."""
    elastic = sorted((PACKAGE / "elastic").glob("*.py"))
    assert [p.name for p in elastic if imports_ray(p)] == []
    graph = import_graph()
    reaching = sorted(
        f"{module} -> {target}"
        for module, imported in graph.items()
        if folder_of(module) == "elastic"
        for target in imported
        if folder_of(target) == "ray_group"
    )
    assert reaching == []
    assert imports_ray(PACKAGE / "ray_group" / "port.py")  # the scan sees an import of Ray


def test_cycle_finder_finds_a_hidden_cycle_and_ignores_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "raytrain_ext.parallel.registry" in graph["raytrain_ext.train.loop"]
    found = cycles(graph)
    assert not found, "import cycles (break them; see docs/architecture.md):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Dict[str, Probe]:
    """The new interpreters of the tests below, by test, started together: each imports
    torch or most of the package, and side by side the cores finished this module in
    10-11 s against 16-18 s one after another.  Each runs what its test's path runs and
    nothing more."""
    run_dir = tmp_path_factory.mktemp("train_command")
    saved_run = tmp_path_factory.mktemp("saved_run")
    from raytrain_ext.config import load_config, to_yaml

    saved = load_config(PACKAGE.parent / "configs" / "sft_llama_tiny.yaml")
    (saved_run / "config.yaml").write_text(to_yaml(saved))
    codes = {
        "data_prepare_worker": (
            "import raytrain_ext.prepare.pipeline",
            ("torch", "raytrain_ext.trainer"),
        ),
        "rank": (
            "import raytrain_ext.worker.actor, raytrain_ext.train.loop, "
            "raytrain_ext.parallel.registry",
            ("torch.distributed.pipelining",),
        ),
        "driver": (
            "import raytrain_ext.cli, raytrain_ext.trainer, raytrain_ext.ray_group.port\n"
            "from raytrain_ext.config import load_config\n"
            "from raytrain_ext.inputs.preflight import preflight\n"
            "from raytrain_ext.objectives import check_objective\n"
            "cfg = load_config(None, [])\n"
            "check_objective(cfg)\n",
            ("torch",),
        ),
        "train_command": (
            "import raytrain_ext.trainer\n"
            "def stop_at_fit(self):\n"
            "    raise KeyboardInterrupt\n"
            "raytrain_ext.trainer.Trainer.fit = stop_at_fit\n"
            "from raytrain_ext.cli import main\n"
            f"assert main(['train', 'run.output_dir={run_dir}']) == 130\n",
            ("torch",),
        ),
        "saved_hf_config": (
            "from raytrain_ext.ops.report import load_run_config\n"
            f"cfg = load_run_config({str(saved_run)!r})\n"
            f"assert (cfg.model.source.value, cfg.model.d_model) == ('hf', {saved.model.d_model})\n",
            ("torch", "transformers"),
        ),
    }
    return {name: Probe(code, modules) for name, (code, modules) in codes.items()}


def test_a_data_prepare_worker_imports_neither_torch_nor_the_trainer(probes):
    """What a ``data prepare`` Ray task imports: its module, not torch (3.3 s per worker
    process when the package's ``__init__`` imported the trainer)."""
    assert probes["data_prepare_worker"].modules() == []


def test_a_rank_without_pipeline_stages_does_not_import_pipelining(probes):
    """What every rank's process imports before its first step (the process pool's list:
    the actor, the loop, the strategies' registry) leaves out
    ``torch.distributed.pipelining``: 0.35 s of each rank's start, which only a run with
    ``parallel.pp > 1`` uses."""
    assert probes["rank"].modules() == []


def test_the_driver_checks_a_config_and_builds_its_trainer_without_torch(probes):
    """What ``raytrain-ext train`` runs before its workers: the CLI, the config, the
    preflight, the trainer, the controller and the worker group's module.  None of it
    imports torch (2-3 s of the command's start when the config checks imported the
    strategies, and the worker group the process-group code)."""
    assert probes["driver"].modules() == []


def test_the_train_command_imports_no_torch_before_its_fit(probes):
    """The ``train`` command itself, up to ``Trainer.fit`` (stopped there): what it imports
    on its own path counts too (the failed-save lines' module imported torch, 0.8 s of every
    start, which the list of modules above did not see)."""
    assert probes["train_command"].modules() == []


def test_reading_a_hugging_face_runs_saved_config_imports_neither_torch_nor_transformers(probes):
    """``report`` and ``ckpt export`` read the run's own ``config.yaml``, which holds the
    model's resolved shape (``configs/sft_llama_tiny.yaml``'s, saved): resolving the model
    source again imported transformers and torch (2.3 s of a 3.4 s ``report``)."""
    assert probes["saved_hf_config"].modules() == []
