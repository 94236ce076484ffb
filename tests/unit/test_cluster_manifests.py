"""The Kubernetes and Ray cluster manifests in cluster/ are valid and agree with the code.

Pure checks (no Kubernetes, no Ray runtime): RayJobs validate against the strict JSON Schemas
of the real KubeRay CRDs (../shared/schemas), the `ray up` config against Ray's own
validator, queue and priority references resolve, entrypoint paths and overrides load with
the project's config loader, and the preemption timing budget leaves the emergency
checkpoint its full `checkpoint.preemption_grace_s`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from raytrain_ext.checkpoint.config import CheckpointConfig
from raytrain_ext.config import load_config

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
SCHEMAS = REPO.parent / "shared" / "schemas"
IMAGE_WORKDIR = "/home/ray/raytrain-ext"  # WORKDIR of cluster/Dockerfile
RAYJOB_FILES = ["rayjob.yaml", "kueue/rayjob.yaml", "volcano/rayjob.yaml"]
TIERS = ["urgent-finetune", "regular-training", "experimental"]  # highest priority first


def _docs(relpath: str) -> list[dict]:
    with open(CLUSTER / relpath) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _kind(relpath: str, kind: str) -> list[dict]:
    return [d for d in _docs(relpath) if d.get("kind") == kind]


def _rayjob(relpath: str) -> dict:
    (job,) = _kind(relpath, "RayJob")
    return job


def _validator(name: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / name
    if not path.exists():
        pytest.skip(f"{path} is absent: the KubeRay CRD schemas live in ../shared/schemas")
    return _load_validator(path)


@functools.lru_cache(maxsize=None)
def _load_validator(path: Path) -> jsonschema.Draft7Validator:
    """Draft 7 with additionalProperties as the CRD gives it; x-kubernetes-* keys are ignored."""
    schema = json.loads(path.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _pod_templates(job: dict) -> dict[str, dict]:
    spec = job["spec"]["rayClusterSpec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]})
    return templates


def _entrypoint_args(job: dict) -> list[str]:
    """The entrypoint as the job sees it, after the submitter's shell expanded
    ``${VAR}`` / ``${VAR:?message}`` (here to sample values)."""
    samples = {"DATA_PATH": "s3://bucket/data/", "CHECKPOINT_S3_PREFIX": "s3://bucket/ckpt"}
    expanded = re.sub(
        r"\$\{(\w+)(:\?[^}]*)?\}", lambda m: samples[m.group(1)], job["spec"]["entrypoint"]
    )
    return shlex.split(expanded)


def _overrides(job: dict) -> list[str]:
    return [a for a in _entrypoint_args(job) if "=" in a and not a.startswith("--")]


def _prestop_command(template: dict) -> str:
    (container,) = template["spec"]["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"], command
    return command[2]


def _sleep_s(command: str) -> int:
    match = re.search(r"\bsleep (\d+)\s*$", command)
    assert match, f"preStop must end with `sleep N`: {command!r}"
    return int(match.group(1))


# ---- parsing and CRD schemas --------------------------------------------------------------


def test_every_yaml_under_cluster_parses_and_names_its_kind():
    files = sorted(CLUSTER.rglob("*.yaml"))
    assert len(files) >= 8
    for path in files:
        docs = _docs(str(path.relative_to(CLUSTER)))
        assert docs, f"{path} is empty"
        if path.name == "ray-cluster-aws.yaml":
            continue
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path


@pytest.mark.parametrize("relpath", RAYJOB_FILES)
def test_rayjob_validates_against_the_kuberay_crd_schema(relpath):
    validator = _validator("rayjob-ray.io-v1.json")
    job = _rayjob(relpath)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(job)]
    assert errors == []
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] > 0 and spec["backoffLimit"] >= 1


def test_raycluster_spec_of_the_rayjob_validates_as_a_raycluster():
    validator = _validator("raycluster-ray.io-v1.json")
    job = _rayjob("rayjob.yaml")
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "gpt-1b"},
        "spec": job["spec"]["rayClusterSpec"],
    }
    assert [e.message for e in validator.iter_errors(cluster)] == []


@pytest.mark.parametrize(
    "path, typo",
    [
        (("spec",), "shutdownAfterJobFinish"),
        (("spec", "rayClusterSpec", "workerGroupSpecs", 0), "replica"),
        (("spec", "rayClusterSpec", "headGroupSpec", "template", "spec"), "terminationGracePeriod"),
    ],
)
def test_schema_validation_is_strict_about_typos(path, typo):
    validator = _validator("rayjob-ray.io-v1.json")
    job = copy.deepcopy(_rayjob("rayjob.yaml"))
    node = job
    for key in path:
        node = node[key]
    node[typo] = 1
    messages = [e.message for e in validator.iter_errors(job)]
    assert any(f"'{typo}' was unexpected" in m for m in messages), messages


def test_rayjob_gpu_workers_and_shared_memory():
    job = _rayjob("rayjob.yaml")
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    for name, template in _pod_templates(job).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (container,) = template["spec"]["containers"]
        shm = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm and volumes[shm[0]]["emptyDir"]["medium"] == "Memory", name
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]


# ---- credentials, entrypoint, config ------------------------------------------------------


@pytest.mark.parametrize("relpath", RAYJOB_FILES)
def test_credentials_come_from_a_secret_never_from_the_files(relpath):
    job = _rayjob(relpath)
    for name, template in _pod_templates(job).items():
        (container,) = template["spec"]["containers"]
        secrets = [e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e]
        assert secrets == ["raytrain-ext-aws"], name
    text = (CLUSTER / relpath).read_text()
    assert not re.search(r"AKIA[0-9A-Z]{16}", text)
    assert "AWS_SECRET_ACCESS_KEY:" not in text


@pytest.mark.parametrize("relpath", RAYJOB_FILES)
def test_entrypoint_paths_exist_and_overrides_load_with_the_project_loader(relpath):
    job = _rayjob(relpath)
    args = _entrypoint_args(job)
    assert args[:2] == ["python", "jobs/train.py"]
    config = args[args.index("--config") + 1]
    working_dir = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["working_dir"]
    assert working_dir == IMAGE_WORKDIR
    assert (REPO / args[1]).is_file() and (REPO / config).is_file()
    cfg = load_config(REPO / config, _overrides(job))
    assert cfg.checkpoint.resume == "auto"
    assert cfg.checkpoint.s3.uri == f"s3://bucket/ckpt/{cfg.run.name}"
    assert cfg.run.name == job["metadata"]["name"]  # one S3 prefix per job


def test_submitter_gets_the_variables_the_entrypoint_expands():
    configmap = _kind("run-config.yaml", "ConfigMap")[0]
    for relpath in RAYJOB_FILES:
        job = _rayjob(relpath)
        used = set(re.findall(r"\$\{(\w+)", job["spec"]["entrypoint"]))
        (submitter,) = job["spec"]["submitterPodTemplate"]["spec"]["containers"]
        refs = [e["configMapRef"]["name"] for e in submitter["envFrom"]]
        assert refs == [configmap["metadata"]["name"]]
        assert used and used <= set(configmap["data"]), relpath


def test_ray_up_config_passes_rays_own_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = _docs("ray-cluster-aws.yaml")[0]
    validate_config(prepare_config(copy.deepcopy(raw)))  # what `ray up` runs, minus AWS calls
    workers = raw["available_node_types"]["worker.gpu.spot"]
    assert workers["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}
    assert (
        workers["resources"]["GPU"] == 8
        and "GPU" not in raw["available_node_types"][raw["head_node_type"]]["resources"]
    )
    assert any("pip install" in c and "raytrain-ext" in c for c in raw["setup_commands"])
    broken = copy.deepcopy(raw)
    broken["setup_command"] = broken.pop("setup_commands")
    with pytest.raises(jsonschema.ValidationError, match="setup_command"):
        validate_config(prepare_config(broken))


# ---- preemption timing budget -------------------------------------------------------------


@pytest.mark.parametrize("relpath", RAYJOB_FILES)
def test_preemption_budget_gives_the_emergency_checkpoint_its_grace(relpath):
    job = _rayjob(relpath)
    grace_s = load_config(
        REPO / "configs/gpt_1b_2x8gpu.yaml", _overrides(job)
    ).checkpoint.preemption_grace_s
    assert CheckpointConfig.preemption_grace_s == 30.0  # the default documented in the YAML
    sleeps = {}
    for name, template in _pod_templates(job).items():
        spec = template["spec"]
        sleep_s = _sleep_s(_prestop_command(template))
        sleeps[name] = sleep_s
        # preStop first (checkpoint triggered, sleep covers it), then SIGTERM to `ray start`,
        # whose drain notice is the fallback trigger with the full grace again.
        assert sleep_s >= grace_s + 10, name
        assert spec["terminationGracePeriodSeconds"] > sleep_s + grace_s, name
        env = {e["name"]: e.get("value") for e in spec["containers"][0].get("env", [])}
        assert float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]) >= grace_s, name
    assert sleeps["head"] >= max(sleeps.values())  # driver and GCS outlive the checkpoint


@pytest.mark.parametrize("relpath", RAYJOB_FILES)
def test_worker_prestop_runs_the_signal_script_shipped_in_the_image(relpath):
    job = _rayjob(relpath)
    for name, template in _pod_templates(job).items():
        if name == "head":
            continue
        script = shlex.split(_prestop_command(template).split(";")[0])[-1]
        assert script.startswith(IMAGE_WORKDIR + "/")
        assert (REPO / script[len(IMAGE_WORKDIR) + 1 :]).is_file()
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert f"WORKDIR {IMAGE_WORKDIR}" in dockerfile


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-Urpf", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(
    not _unshare_works(),
    reason="needs unshare (user + PID namespaces) to "
    "signal only processes of this test, never the machine's real Ray workers",
)
def test_signal_script_sigterms_training_workers_and_nothing_else(tmp_path):
    """Runs in a private PID namespace: a fake `ray::TrainWorker.fit` and a bystander
    `ray::IDLE` each record the signals they get."""
    fake = (
        "import signal, sys, time, pathlib\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "signal.signal(signal.SIGTERM, lambda *a: (out.write_text('SIGTERM'), sys.exit(0)))\n"
        "out.write_text('ready')\n"
        "time.sleep(30)\n"
    )
    (tmp_path / "fake.py").write_text(fake)
    inner = (
        f"exec -a ray::TrainWorker.fit {sys.executable} {tmp_path}/fake.py "
        f"{tmp_path}/worker & "
        f"exec -a ray::IDLE {sys.executable} {tmp_path}/fake.py {tmp_path}/idle & "
        f"while [ ! -s {tmp_path}/worker ] || [ ! -s {tmp_path}/idle ]; do sleep 0.05; done; "
        f"/bin/sh {CLUSTER}/signal_training_workers.sh; wait %1; "
        f"kill -KILL %2"
    )
    started = time.time()
    out = subprocess.run(
        ["unshare", "-Urpf", "--mount-proc", "bash", "-c", inner],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert re.fullmatch(r"SIGTERM -> training worker pid \d+\n", out.stdout), out
    assert (tmp_path / "worker").read_text() == "SIGTERM"
    assert (tmp_path / "idle").read_text() == "ready"
    assert time.time() - started < 20


# ---- Kueue and Volcano ----------------------------------------------------------------------


def _priority_values(relpath: str, kind: str) -> dict[str, int]:
    return {d["metadata"]["name"]: d["value"] for d in _kind(relpath, kind)}


@pytest.mark.parametrize(
    "relpath, kind",
    [
        ("kueue/priority-classes.yaml", "WorkloadPriorityClass"),
        ("volcano/priority-classes.yaml", "PriorityClass"),
    ],
)
def test_three_priority_tiers_ordered_urgent_regular_experimental(relpath, kind):
    values = _priority_values(relpath, kind)
    assert list(values) == TIERS
    assert values[TIERS[0]] > values[TIERS[1]] > values[TIERS[2]] > 0
    for doc in _kind(relpath, kind):
        api = (
            "kueue.x-k8s.io/v1beta1" if kind == "WorkloadPriorityClass" else "scheduling.k8s.io/v1"
        )
        assert doc["apiVersion"] == api and doc["description"]


def test_kueue_queues_and_rayjob_labels_resolve():
    flavors = {d["metadata"]["name"] for d in _kind("kueue/queues.yaml", "ResourceFlavor")}
    (cq,) = _kind("kueue/queues.yaml", "ClusterQueue")
    (lq,) = _kind("kueue/queues.yaml", "LocalQueue")
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    (group,) = cq["spec"]["resourceGroups"]
    assert {f["name"] for f in group["flavors"]} == flavors
    gpu_quota = sum(
        r["nominalQuota"]
        for f in group["flavors"]
        for r in f["resources"]
        if r["name"] == "nvidia.com/gpu"
    )
    job = _rayjob("kueue/rayjob.yaml")
    labels = job["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == lq["metadata"]["name"]
    assert labels["kueue.x-k8s.io/priority-class"] in _priority_values(
        "kueue/priority-classes.yaml", "WorkloadPriorityClass"
    )
    assert job["spec"]["suspend"] is True
    assert job["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is False
    (workers,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    needed = (
        workers["replicas"]
        * workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    )
    assert needed == gpu_quota  # one job fills the queue: a second one must preempt


def test_volcano_queue_priority_and_gang_labels_resolve():
    (queue,) = _kind("volcano/queue.yaml", "Queue")
    assert queue["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    job = _rayjob("volcano/rayjob.yaml")
    labels = job["metadata"]["labels"]
    assert labels["ray.io/scheduler-name"] == "volcano"
    assert labels["volcano.sh/queue-name"] == queue["metadata"]["name"]
    priority = labels["ray.io/priority-class-name"]
    assert priority in _priority_values("volcano/priority-classes.yaml", "PriorityClass")
    for name, template in _pod_templates(job).items():
        assert template["spec"]["priorityClassName"] == priority, name
    assert job["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is False


def test_kueue_and_volcano_jobs_differ_from_the_base_job_only_where_intended():
    base = _rayjob("rayjob.yaml")
    for relpath in RAYJOB_FILES[1:]:
        job = copy.deepcopy(_rayjob(relpath))
        name = job["metadata"]["name"]
        job["spec"].pop("suspend", None)
        job["spec"]["entrypoint"] = job["spec"]["entrypoint"].replace(name, "gpt-1b")
        for template in _pod_templates(job).values():
            template["spec"].pop("priorityClassName", None)
        assert job["spec"] == base["spec"], relpath


def test_signal_script_is_executable_and_posix_sh():
    script = CLUSTER / "signal_training_workers.sh"
    assert os.access(script, os.X_OK)
    check = subprocess.run(["/bin/sh", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert signal.SIGTERM.value == 15  # the script sends -TERM, what TrainWorker handles
