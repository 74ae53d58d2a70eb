"""deploy/k8s, rendered by the real `kubectl kustomize` and checked offline: no cluster.

Each kustomization (the base and every overlay) is built the way deploy/k8s/README.md
says, every object is validated against the Kubernetes API schemas (kubernetes-validate,
strict: unknown fields are errors), and then the properties the processes depend on are
checked against the code: each `tandem` command against the CLI, each TANDEM_* variable
against the process's settings class, probes and scrape annotations against the port the
process serves, the learner's rendezvous against its StatefulSet and headless Service.
How little each pod is trusted is checked too: the network policies are evaluated into who
may connect to whom on which port, and every container's token, privileges and limits.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from services.config import ApiSettings, JudgeProxySettings, LearnerSettings, RolloutSettings
from services.config.settings import _ProcessSettings
from tandem.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
SECRETS_EXAMPLE = K8S / "secrets.env.example"

KUBERNETES_VERSION = "1.30"
"""The oldest Kubernetes release whose API schemas the manifests must satisfy."""

TARGETS = ("base", "overlays/cpu", "overlays/gpu", "overlays/gpu-multinode")
OVERLAYS = TARGETS[1:]
GPU_OVERLAYS = ("overlays/gpu", "overlays/gpu-multinode")
NAMESPACE = "tandem"
SECRET = "tandem-secrets"

SETTINGS = {
    "api": ApiSettings,
    "judge-proxy": JudgeProxySettings,
    "rollout": RolloutSettings,
    "learner": LearnerSettings,
}
"""`tandem <process>` -> the settings class that process reads its environment into."""

SERVED_PORT_VARIABLE = {
    "api": "TANDEM_PORT",
    "judge-proxy": "TANDEM_PORT",
    "rollout": "TANDEM_METRICS_PORT",
    "learner": "TANDEM_METRICS_PORT",
}
"""The variable holding the port a process serves /healthz and /metrics on."""

SECRET_NAME = re.compile(r"(PASSWORD|TOKENS?|SECRET|_KEY|_AUTH|REDIS_URL)$")
"""Environment variable names whose values are secrets."""

REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        if os.environ.get("TANDEM_REQUIRE_KUBECTL"):
            pytest.fail("TANDEM_REQUIRE_KUBECTL is set but no kubectl is on PATH")
        pytest.skip("kubectl is not installed: it renders deploy/k8s (Debian package kubectl)")
    return found


def build(path: Path) -> list[dict]:
    """`kubectl kustomize` of a kustomization folder with kustomize's default load
    restrictor, as `kubectl apply -k` builds it: nothing outside the folder is read."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def render(target: str) -> list[dict]:
    """The objects a target (a folder under deploy/k8s) builds to; shared, not to be modified."""
    return build(K8S / target)


def of_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict]) -> dict[str, dict]:
    return {**of_kind(objects, "Deployment"), **of_kind(objects, "StatefulSet")}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def process_of(container: dict) -> str | None:
    command = container.get("command") or [None, None]
    return command[1] if command[0] == "tandem" and command[1] in SETTINGS else None


def tandem_workloads(objects: list[dict]) -> dict[str, tuple[dict, dict]]:
    """process -> (workload, container) for each workload running a Tandem process."""
    found = {}
    for workload in workloads(objects).values():
        for container in pod_spec(workload)["containers"]:
            if process := process_of(container):
                assert process not in found, f"two workloads run `tandem {process}`"
                found[process] = (workload, container)
    return found


def processes(target: str) -> dict[str, tuple[dict, dict]]:
    return tandem_workloads(render(target))


def env_entries(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def literal_env(container: dict) -> dict[str, str]:
    return {name: entry["value"] for name, entry in env_entries(container).items() if "value" in entry}


def secret_env(container: dict) -> dict[str, str]:
    """The variables the container reads from tandem-secrets, with secrets.env.example's values."""
    example = dict(
        line.split("=", 1)
        for line in SECRETS_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    return {
        name: example[ref["key"]]
        for name, entry in env_entries(container).items()
        if (ref := entry.get("valueFrom", {}).get("secretKeyRef")) and ref["key"] in example
    }


def expand(text: str, container: dict) -> str:
    """`$(VAR)` replaced by the container's literal value of VAR, as the kubelet does."""
    values = literal_env(container)
    return REFERENCE.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def served_port(process: str, container: dict) -> int:
    return int(literal_env(container)[SERVED_PORT_VARIABLE[process]])


def container_port(container: dict, port: int | str) -> int:
    """A port as a number: a named port resolved against the container's ports."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return number


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In, or a plain map) matches."""
    match_labels = selector.get("matchLabels", {}) if {"matchLabels", "matchExpressions"} & set(selector) else selector
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def gpus(container: dict) -> dict[str, int | None]:
    resources = container.get("resources", {})
    return {part: resources.get(part, {}).get("nvidia.com/gpu") for part in ("requests", "limits")}


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


def volume_of(workload: dict, container: dict, mount_path: str) -> dict:
    """The pod volume a container mounts at `mount_path`, with the mount's readOnly."""
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path]
    (volume,) = [v for v in pod_spec(workload).get("volumes", []) if v["name"] == mount["name"]]
    return {**volume, "mountReadOnly": mount.get("readOnly", False)}


def schema_errors(objects: list[dict]) -> list[str]:
    """Each object that fails strict validation against the Kubernetes API schemas, and why."""
    errors = []
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{name}: {'.'.join(map(str, error.path))}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{name}: {error.message}")
    return errors


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates_strictly_against_the_kubernetes_api_schemas(target):
    objects = render(target)
    assert len(objects) > 20
    assert not schema_errors(objects)


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_fits_the_annotation_that_kubectl_apply_copies_it_into(target):
    """Client-side apply keeps each object as JSON in an annotation of at most 256 KiB (the
    dashboards ConfigMap is the big one)."""
    for obj in render(target):
        size = len(json.dumps(obj, separators=(",", ":")))
        assert size < 256 * 1024, f"{obj['metadata']['name']}: {size} bytes; document `kubectl apply --server-side`"


@pytest.mark.parametrize("target", TARGETS)
def test_everything_lands_in_one_namespace_that_the_manifests_create(target):
    objects = render(target)
    assert list(of_kind(objects, "Namespace")) == [NAMESPACE]
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_tandem_process_runs_once_with_a_command_the_cli_accepts(target):
    running = processes(target)
    assert sorted(running) == sorted(SETTINGS)
    for process, (_, container) in running.items():
        args = build_parser().parse_args([expand(arg, container) for arg in container["command"][1:]])
        assert args.command == process


@pytest.mark.parametrize("target", OVERLAYS)
def test_overlays_run_the_cuda_image_only_for_the_rollout_servers_and_learner_on_gpus(target):
    engine = "tandem-cuda" if target in GPU_OVERLAYS else "tandem-cpu"
    expected = {"api": "tandem-cpu", "judge-proxy": "tandem-cpu", "rollout": engine, "learner": engine}
    for process, (_, container) in processes(target).items():
        name, _, tag = container["image"].rpartition(":")
        assert (name, bool(tag)) == (expected[process], True), f"{process}: {container['image']}"


@pytest.mark.parametrize("target", TARGETS)
def test_tandem_variables_are_fields_of_the_process_settings_and_validate(target):
    for process, (_, container) in processes(target).items():
        settings_class = SETTINGS[process]
        fields = {
            name: name.removeprefix("TANDEM_").lower() for name in env_entries(container) if name.startswith("TANDEM_")
        }
        unknown = sorted(name for name, field in fields.items() if field not in settings_class.model_fields)
        assert not unknown, f"{process}: {settings_class.__name__} has no field for {unknown}"
        values = literal_env(container) | secret_env(container)
        settings_class(**{fields[name]: expand(value, container) for name, value in values.items() if name in fields})


@pytest.mark.parametrize("target", TARGETS)
def test_http_processes_listen_on_all_interfaces_and_their_services_reach_them(target):
    services = of_kind(render(target), "Service")
    for process in ("api", "judge-proxy"):
        workload, container = processes(target)[process]
        assert literal_env(container)["TANDEM_HOST"] == "0.0.0.0", "127.0.0.1 is unreachable from other pods"
        service = services[workload["metadata"]["name"]]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selects(service["spec"]["selector"], labels)
        (port,) = service["spec"]["ports"]
        assert port["port"] == container_port(container, port["targetPort"]) == served_port(process, container)


@pytest.mark.parametrize("target", TARGETS)
def test_api_judge_proxy_and_rollout_probe_healthz_on_the_port_they_serve(target):
    for process in ("api", "judge-proxy", "rollout"):
        _, container = processes(target)[process]
        for probe in ("readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/healthz", (process, probe)
            assert container_port(container, get["port"]) == served_port(process, container), (process, probe)


@pytest.mark.parametrize("target", TARGETS)
def test_rollout_servers_scale_freely_and_are_given_longer_than_their_drain(target):
    workload, container = processes(target)["rollout"]
    assert workload["kind"] == "Deployment"
    assert "replicas" not in workload["spec"], "re-applying the manifests would undo `kubectl scale`"
    assert "TANDEM_SERVER_ID" not in env_entries(container), "replicas would share one server id"
    assert workload["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "a surge pod waits for a free GPU"
    drain_s = RolloutSettings(drain_timeout_s=literal_env(container)["TANDEM_DRAIN_TIMEOUT_S"]).drain_timeout_s
    assert pod_spec(workload)["terminationGracePeriodSeconds"] >= drain_s + 30, "the drain, then vLLM's shutdown"


@pytest.mark.parametrize("target", TARGETS)
def test_learner_nodes_meet_at_the_first_pod_of_the_headless_service(target):
    workload, container = processes(target)["learner"]
    spec = workload["spec"]
    assert workload["kind"] == "StatefulSet" and spec["podManagementPolicy"] == "Parallel"
    args = build_parser().parse_args([expand(arg, container) for arg in container["command"][1:]])
    assert args.resume, "a restarted learner must continue its job"
    assert args.nnodes == spec["replicas"], "LEARNER_NODES must equal the StatefulSet's replicas"
    assert args.rdzv_id
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{workload['metadata']['name']}-0.{spec['serviceName']}"

    service = of_kind(render(target), "Service")[spec["serviceName"]]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert selects(service["spec"]["selector"], spec["template"]["metadata"]["labels"])
    store_port = int(literal_env(container)["TANDEM_WEIGHT_STORE_PORT"])
    assert store_port != 0, "a random store port is unreachable through the Service"
    ports = {container_port(container, p["targetPort"]) for p in service["spec"]["ports"]}
    assert {int(port), store_port, served_port("learner", container)} <= ports


@pytest.mark.parametrize("target", TARGETS)
def test_each_learner_pod_advertises_its_own_stable_name(target):
    workload, container = processes(target)["learner"]
    names = list(env_entries(container))
    pod_name = env_entries(container)["POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert names.index("POD_NAME") < names.index("TANDEM_ADVERTISE_HOST"), "$(POD_NAME) must be defined first"
    assert literal_env(container)["TANDEM_ADVERTISE_HOST"] == f"$(POD_NAME).{workload['spec']['serviceName']}"


@pytest.mark.parametrize("target", TARGETS)
def test_every_learner_node_writes_to_one_runs_claim_read_write_many_when_there_are_several(target):
    objects = render(target)
    workload, container = processes(target)["learner"]
    assert "volumeClaimTemplates" not in workload["spec"], "each node would get a volume of its own"
    claim_name = volume_of(workload, container, literal_env(container)["TANDEM_RUNS_DIR"])["persistentVolumeClaim"]
    modes = of_kind(objects, "PersistentVolumeClaim")[claim_name["claimName"]]["spec"]["accessModes"]
    if workload["spec"]["replicas"] > 1:
        assert "ReadWriteMany" in modes
    assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300, "rank 0 checkpoints"


def test_the_multinode_overlay_spans_several_learner_nodes():
    workload, _ = processes("overlays/gpu-multinode")["learner"]
    assert workload["spec"]["replicas"] > 1


@pytest.mark.parametrize("target", GPU_OVERLAYS)
def test_gpu_overlays_give_each_rollout_server_a_gpu_and_each_learner_rank_one(target):
    _, rollout = processes(target)["rollout"]
    _, learner = processes(target)["learner"]
    assert gpus(rollout) == {"requests": 1, "limits": 1}
    ranks = int(literal_env(learner)["LEARNER_NPROC_PER_NODE"])
    assert gpus(learner) == {"requests": ranks, "limits": ranks}


@pytest.mark.parametrize("target", ["base", "overlays/cpu"])
def test_cpu_builds_request_no_gpu(target):
    for workload in workloads(render(target)).values():
        for container in pod_spec(workload)["containers"]:
            assert gpus(container) == {"requests": None, "limits": None}, workload["metadata"]["name"]
    if target == "overlays/cpu":
        _, rollout = processes(target)["rollout"]
        assert float(literal_env(rollout)["TANDEM_KV_CACHE_GIB"]) > 0


@pytest.mark.parametrize("target", OVERLAYS)
def test_rollout_servers_and_learner_get_a_memory_backed_dev_shm(target):
    for process in ("rollout", "learner"):
        workload, container = processes(target)[process]
        volume = volume_of(workload, container, "/dev/shm")
        assert volume["emptyDir"]["medium"] == "Memory", process
        assert volume["emptyDir"]["sizeLimit"], process


@pytest.mark.parametrize("target", TARGETS)
def test_the_api_rollout_servers_and_learner_read_models_from_one_read_only_claim(target):
    claims = of_kind(render(target), "PersistentVolumeClaim")
    running = processes(target)
    assert literal_env(running["api"][1])["TANDEM_PATH_ROOTS"] == "/models"
    for process in ("api", "rollout", "learner"):
        volume = volume_of(*running[process], "/models")
        claim = volume["persistentVolumeClaim"]
        assert claim == {"claimName": "tandem-models", "readOnly": True} and volume["mountReadOnly"], process
    assert claims["tandem-models"]["spec"]["accessModes"] == ["ReadOnlyMany"]


@pytest.mark.parametrize("target", TARGETS)
def test_redis_keeps_an_append_only_file_on_its_own_volume_and_requires_the_password(target):
    redis = of_kind(render(target), "StatefulSet")["tandem-redis"]
    (container,) = pod_spec(redis)["containers"]
    args = " ".join(container["command"] + container["args"])
    assert "--appendonly yes" in args and "--appendfsync everysec" in args
    assert "--requirepass $(REDIS_PASSWORD)" in args
    assert env_entries(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": SECRET,
        "key": "REDIS_PASSWORD",
    }
    assert env_entries(container)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]["key"] == "REDIS_PASSWORD"
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
    assert data["name"] in [t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == ["sh", "-c", "redis-cli ping | grep -q PONG"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_tandem_process_reads_the_whole_redis_url_from_the_secret(target):
    for process, (_, container) in processes(target).items():
        assert env_entries(container)["TANDEM_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": SECRET,
            "key": "TANDEM_REDIS_URL",
        }, process


def test_the_example_redis_url_names_the_redis_service_and_carries_the_password():
    example = read_env_file(SECRETS_EXAMPLE)
    url = urlsplit(example["TANDEM_REDIS_URL"])
    service = of_kind(render("base"), "Service")["tandem-redis"]
    assert (url.scheme, url.hostname, url.port) == ("redis", "tandem-redis", service["spec"]["ports"][0]["port"])
    assert url.password == example["REDIS_PASSWORD"]


@pytest.mark.parametrize("target", TARGETS)
def test_no_secret_value_is_written_into_a_manifest(target):
    objects = render(target)
    assert not of_kind(objects, "Secret"), "Secrets are created by the user, never rendered"
    secret_variables = {f"TANDEM_{name.upper()}" for name in _ProcessSettings.SECRETS}
    upstream_keys = {
        u["api_key_env"]
        for path in (ROOT / "deploy" / "configs").glob("judge_upstreams*.yaml")
        for u in yaml.safe_load(path.read_text())["upstreams"]
        if "api_key_env" in u
    }
    assert upstream_keys
    for workload in workloads(objects).values():
        for container in pod_spec(workload)["containers"]:
            for name, entry in env_entries(container).items():
                if name in secret_variables | upstream_keys or SECRET_NAME.search(name):
                    assert "secretKeyRef" in entry.get("valueFrom", {}), f"{container['name']}: {name}"
            for source in container.get("envFrom", []):
                assert set(source) == {"secretRef"}, f"{container['name']}: envFrom {source}"


def test_the_secret_keys_the_manifests_read_are_the_ones_the_example_lists():
    referenced = set()
    for target in TARGETS:
        for workload in workloads(render(target)).values():
            for container in pod_spec(workload)["containers"]:
                for entry in env_entries(container).values():
                    ref = entry.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] == SECRET, ref
                        referenced.add(ref["key"])
    example = read_env_file(SECRETS_EXAMPLE)
    assert referenced == set(example)
    assert all("replace-me" in value for value in example.values()), "the example holds placeholders only"


@pytest.mark.parametrize("target", TARGETS)
def test_the_judge_proxy_mounts_the_upstreams_example_of_deploy_configs_and_reads_its_keys_from_a_secret(target):
    objects = render(target)
    workload, container = processes(target)["judge-proxy"]
    volume = volume_of(workload, container, "/etc/tandem")
    config_map = of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]
    example = ROOT / "deploy" / "configs" / "judge_upstreams.example.yaml"
    assert config_map["data"] == {example.name: example.read_text()}
    assert literal_env(container)["TANDEM_UPSTREAMS"] == "", "no upstreams unless an overlay adds a file"
    assert container["envFrom"] == [{"secretRef": {"name": "tandem-judge-keys", "optional": True}}]
    _, rollout = processes(target)["rollout"]
    judge = urlsplit(literal_env(rollout)["TANDEM_JUDGE_URL"])
    assert judge.hostname == workload["metadata"]["name"] and judge.port == served_port("judge-proxy", container)
    assert (
        env_entries(rollout)["TANDEM_JUDGE_TOKEN"]["valueFrom"]["secretKeyRef"]
        == env_entries(container)["TANDEM_CLIENT_TOKENS"]["valueFrom"]["secretKeyRef"]
    )


def test_an_overlay_adds_its_own_upstreams_file_as_deploy_k8s_readme_shows(tmp_path):
    example = ROOT / "deploy" / "configs" / "judge_upstreams.example.yaml"
    (tmp_path / "judge_upstreams.yaml").write_text(example.read_text())
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "tandem-judge-proxy"},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "judge-proxy",
                            "env": [{"name": "TANDEM_UPSTREAMS", "value": "/etc/tandem/judge_upstreams.yaml"}],
                        }
                    ]
                }
            }
        },
    }
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
                "configMapGenerator": [
                    {"name": "tandem-judge-upstreams", "behavior": "merge", "files": ["judge_upstreams.yaml"]}
                ],
                "patches": [{"patch": yaml.safe_dump(patch)}],
            }
        )
    )
    objects = build(tmp_path)
    workload, container = tandem_workloads(objects)["judge-proxy"]
    upstreams = Path(literal_env(container)["TANDEM_UPSTREAMS"])
    volume = volume_of(workload, container, str(upstreams.parent))
    assert set(of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]) == {example.name, upstreams.name}
    assert not schema_errors(objects)


@pytest.mark.parametrize("target", TARGETS)
def test_every_tandem_pod_is_annotated_for_prometheus_with_the_port_its_process_serves(target):
    for process, (workload, container) in processes(target).items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        port = served_port(process, container)
        assert annotations == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }, process
        assert port in [p["containerPort"] for p in container["ports"]], process


def prometheus_files(objects: list[dict]) -> tuple[str, dict[str, str]]:
    """The name of Prometheus's config file and every file beside it (its ConfigMap's data)."""
    deployment = of_kind(objects, "Deployment")["tandem-prometheus"]
    (container,) = pod_spec(deployment)["containers"]
    path = Path(next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--config.file=")))
    volume = volume_of(deployment, container, str(path.parent))
    return path.name, of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"]


def prometheus_config(objects: list[dict]) -> dict:
    name, files = prometheus_files(objects)
    return yaml.safe_load(files[name])


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus's keep and replace relabeling (anchored regex, `$n` groups); None: dropped."""
    labels = dict(labels)
    for rule in rules:
        value = ";".join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        assert action in ("keep", "replace"), action
        if action == "keep" and not match:
            return None
        if action == "replace" and match:
            labels[rule["target_label"]] = match.expand(re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1")))
    return labels


def discovered_pod(name: str, ip: str, annotations: dict[str, str], component: str) -> dict[str, str]:
    """The labels Prometheus's pod discovery gives a pod declaring port 29400."""
    labels = {
        "__address__": f"{ip}:29400" if ":" not in ip else f"[{ip}]:29400",
        "__metrics_path__": "/metrics",
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_namespace": NAMESPACE,
        "__meta_kubernetes_pod_label_app_kubernetes_io_component": component,
    }
    for key, value in annotations.items():
        labels["__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    return labels


def test_prometheus_scrapes_each_annotated_pod_of_its_namespace_on_the_annotated_port():
    objects = render("base")
    config = prometheus_config(objects)
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    assert job["honor_labels"] is True, "without honor_labels the dashboards' job label becomes exported_job"
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"own_namespace": True}}]
    workload, _ = processes("base")["learner"]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    for ip, address in (("10.1.2.3", "10.1.2.3:8003"), ("fd00::7", "[fd00::7]:8003")):
        target = relabel(discovered_pod("tandem-learner-1", ip, annotations, "learner"), job["relabel_configs"])
        assert {k: target[k] for k in ("__address__", "__metrics_path__", "process", "instance", "namespace")} == {
            "__address__": address,
            "__metrics_path__": "/metrics",
            "process": "learner",
            "instance": "tandem-learner-1",
            "namespace": NAMESPACE,
        }
    assert relabel(discovered_pod("tandem-redis-0", "10.1.2.4", {}, "redis"), job["relabel_configs"]) is None


def test_prometheus_config_passes_promtool_with_static_targets_in_place_of_discovery(tmp_path):
    """Debian's promtool is built without Kubernetes discovery: the rest of the config is checked."""
    if shutil.which("promtool") is None:
        if os.environ.get("TANDEM_REQUIRE_PROMETHEUS"):
            pytest.fail("TANDEM_REQUIRE_PROMETHEUS is set but no promtool is on PATH")
        pytest.skip("promtool (Prometheus's checker) is not installed")
    objects = render("base")
    config = prometheus_config(objects)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": ["pod:8000"]}]
        del job["kubernetes_sd_configs"]
    for name, text in prometheus_files(objects)[1].items():  # the rule files it names, from its ConfigMap
        (tmp_path / name).write_text(text)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_may_only_read_pods_in_its_namespace():
    objects = render("base")
    (role,) = of_kind(objects, "Role").values()
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    (binding,) = of_kind(objects, "RoleBinding").values()
    account = pod_spec(of_kind(objects, "Deployment")["tandem-prometheus"])["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert account in of_kind(objects, "ServiceAccount")


def test_grafana_mounts_every_dashboard_file_unchanged_from_one_configmap():
    objects = render("base")
    config_maps = of_kind(objects, "ConfigMap")
    grafana = of_kind(objects, "Deployment")["tandem-grafana"]
    (container,) = pod_spec(grafana)["containers"]
    provider_volume = volume_of(grafana, container, "/etc/grafana/provisioning/dashboards")
    provider_file = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "tandem.yaml"
    assert config_maps[provider_volume["configMap"]["name"]]["data"] == {"tandem.yaml": provider_file.read_text()}
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    dashboards = volume_of(grafana, container, provider["options"]["path"])
    assert DASHBOARDS
    assert config_maps[dashboards["configMap"]["name"]]["data"] == {p.name: p.read_text() for p in DASHBOARDS}
    home = Path(literal_env(container)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == Path(provider["options"]["path"]) and home.name in {p.name for p in DASHBOARDS}
    password = env_entries(container)["GF_SECURITY_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert password == {"name": SECRET, "key": "GRAFANA_ADMIN_PASSWORD"}


def test_grafana_lets_no_anonymous_viewer_in():
    grafana = of_kind(render("base"), "Deployment")["tandem-grafana"]
    (container,) = pod_spec(grafana)["containers"]
    assert literal_env(container)["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_grafanas_datasource_is_the_prometheus_service_with_the_uid_the_dashboards_name():
    objects = render("base")
    grafana = of_kind(objects, "Deployment")["tandem-grafana"]
    (container,) = pod_spec(grafana)["containers"]
    volume = volume_of(grafana, container, "/etc/grafana/provisioning/datasources")
    (text,) = of_kind(objects, "ConfigMap")[volume["configMap"]["name"]]["data"].values()
    (source,) = yaml.safe_load(text)["datasources"]
    compose_file = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
    (compose_source,) = yaml.safe_load(compose_file.read_text())["datasources"]
    assert {k: v for k, v in source.items() if k != "url"} == {k: v for k, v in compose_source.items() if k != "url"}
    url = urlsplit(source["url"])
    service = of_kind(objects, "Service")[url.hostname]
    assert service["spec"]["ports"][0]["port"] == url.port
    assert selects(
        service["spec"]["selector"],
        of_kind(objects, "Deployment")["tandem-prometheus"]["spec"]["template"]["metadata"]["labels"],
    )
    assert source["jsonData"]["timeInterval"] == prometheus_config(objects)["global"]["scrape_interval"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_service_selects_a_workload_and_targets_a_port_it_declares(target):
    objects = render(target)
    for name, service in of_kind(objects, "Service").items():
        matched = [
            w
            for w in workloads(objects).values()
            if selects(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        (container,) = pod_spec(matched[0])["containers"]
        for port in service["spec"]["ports"]:
            container_port(container, port["targetPort"])


@pytest.mark.parametrize("target", TARGETS)
def test_every_configmap_and_claim_a_pod_mounts_is_rendered(target):
    objects = render(target)
    for workload in workloads(objects).values():
        for volume in pod_spec(workload).get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in of_kind(objects, "ConfigMap"), volume
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in of_kind(objects, "PersistentVolumeClaim")


EPHEMERAL_PORT = 40000
"""A port no manifest names: where gloo and NCCL put the broadcast's and collectives' connections."""

OUTSIDE = {
    "dns": {
        "namespace": "kube-system",
        "labels": {"k8s-app": "kube-dns"},
        "ip": "10.244.9.2",
        "ports": [("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")],
    },
    "dns-impostor": {
        "namespace": "tenant",
        "labels": {"k8s-app": "kube-dns"},
        "ip": "10.244.9.3",
        "ports": [("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")],
    },
    "another-namespace": {
        "namespace": "tenant",
        "labels": {"app": "shop"},
        "ip": "10.244.9.4",
        "ports": [("https", 443, "TCP"), ("redis", 6379, "TCP"), ("http", 8080, "TCP")],
    },
    "kubernetes-api": {"namespace": None, "labels": {}, "ip": "172.18.0.2", "ports": [("https", 6443, "TCP")]},
    "cloud-metadata": {"namespace": None, "labels": {}, "ip": "169.254.169.254", "ports": [("http", 80, "TCP")]},
    "internet": {
        "namespace": None,
        "labels": {},
        "ip": "203.0.113.7",
        "ports": [("https", 443, "TCP"), ("http", 80, "TCP")],
    },
    "internet-v6": {"namespace": None, "labels": {}, "ip": "2001:db8::7", "ports": [("https", 443, "TCP")]},
    "private-v6": {"namespace": None, "labels": {}, "ip": "fd00:ec2::254", "ports": [("http", 80, "TCP")]},
}
"""Endpoints around the namespace (namespace None: an address, not a pod), each port as
(name, number, protocol); pod addresses are in the cluster's private range."""

EVERYWHERE = {53, "53/udp", 80, 443, 3000, 6379, 6443, 8000, 8001, 8002, 8003, 8080, 9090, 29400, 29600, EPHEMERAL_PORT}
"""Every port the endpoints above and Tandem's pods listen on."""

EXPECTED_REACH = {
    "api": {"dns": {53, "53/udp"}, "redis": {6379}},
    "judge-proxy": {"dns": {53, "53/udp"}, "redis": {6379}, "internet": {80, 443}, "internet-v6": {443}},
    "rollout": {
        "dns": {53, "53/udp"},
        "redis": {6379},
        "judge-proxy": {8001},
        "learner": {8003, 29400, 29600, EPHEMERAL_PORT},
    },
    "learner": {
        "dns": {53, "53/udp"},
        "redis": {6379},
        "learner": {8003, 29400, 29600, EPHEMERAL_PORT},
        "rollout": {8002, EPHEMERAL_PORT},
    },
    "redis": {},
    # The API server's address differs by cluster: its ports are open to any address.
    "prometheus": {
        "dns": {53, "53/udp"},
        "api": {8000},
        "judge-proxy": {8001},
        "rollout": {8002},
        "learner": {8003},
        "kubernetes-api": {6443},
        "internet": {443},
        "internet-v6": {443},
        "another-namespace": {443},
    },
    "grafana": {"dns": {53, "53/udp"}, "prometheus": {9090}},
    "another-namespace": {"api": {8000}},
}
"""Source -> destination -> the ports it may open there, egress and ingress policies together."""


def pod_endpoints(objects: list[dict]) -> dict[str, dict]:
    """component -> one of its pods as an endpoint, listening on its declared ports and on
    a port the collectives pick."""
    pods = {}
    for number, workload in enumerate(workloads(objects).values()):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        ports = [
            (port.get("name", ""), port["containerPort"], port.get("protocol", "TCP"))
            for container in pod_spec(workload)["containers"]
            for port in container.get("ports", [])
        ]
        pods[labels["app.kubernetes.io/component"]] = {
            "namespace": NAMESPACE,
            "labels": labels,
            "ip": f"10.244.0.{10 + number}",
            "ports": ports + [("", EPHEMERAL_PORT, "TCP")],
        }
    return pods


def port_admits(entry: dict, port: tuple[str, int, str], destination: dict) -> bool:
    """Whether a NetworkPolicyPort covers `port`; a named port is the destination pod's."""
    _, number, protocol = port
    if entry.get("protocol", "TCP") != protocol:
        return False
    if "port" not in entry:
        return True
    if isinstance(entry["port"], str):
        return (entry["port"], number, protocol) in destination["ports"]
    return entry["port"] <= number <= entry.get("endPort", entry["port"])


def peer_admits(peer: dict, policy_namespace: str, endpoint: dict) -> bool:
    """Whether a NetworkPolicyPeer (of a policy in `policy_namespace`) covers `endpoint`."""
    if "ipBlock" in peer:
        address = ipaddress.ip_address(endpoint["ip"])

        def inside(cidr: str) -> bool:
            network = ipaddress.ip_network(cidr)
            return address.version == network.version and address in network

        return inside(peer["ipBlock"]["cidr"]) and not any(map(inside, peer["ipBlock"].get("except", [])))
    if endpoint["namespace"] is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": endpoint["namespace"]}):
            return False
    elif endpoint["namespace"] != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), endpoint["labels"])


def policies_of(objects: list[dict], pod: dict, direction: str) -> list[dict]:
    """The NetworkPolicies isolating `pod` in `direction` (Ingress or Egress)."""
    return [
        p
        for p in of_kind(objects, "NetworkPolicy").values()
        if p["metadata"]["namespace"] == pod["namespace"]
        and direction in p["spec"]["policyTypes"]
        and selects(p["spec"]["podSelector"], pod["labels"])
    ]


def admitted(objects: list[dict], direction: str, pod: dict, peer: dict, port: tuple, destination: dict) -> bool:
    """Whether `pod`'s policies let it send to (Egress) or receive from (Ingress) `peer`."""
    if pod["namespace"] is None:
        return True
    policies = policies_of(objects, pod, direction)
    key = "to" if direction == "Egress" else "from"
    return not policies or any(
        (not rule.get(key) or any(peer_admits(p, policy["metadata"]["namespace"], peer) for p in rule[key]))
        and (not rule.get("ports") or any(port_admits(entry, port, destination) for entry in rule["ports"]))
        for policy in policies
        for rule in policy["spec"].get(direction.lower(), [])
    )


def port_label(port: tuple[str, int, str]) -> int | str:
    """A TCP port as its number, any other as `<number>/<protocol>` (53/udp)."""
    _, number, protocol = port
    return number if protocol == "TCP" else f"{number}/{protocol.lower()}"


def reach(objects: list[dict], sources: dict[str, dict], destinations: dict[str, dict]) -> dict[str, dict]:
    """Source -> destination -> the ports (`port_label`) a connection may open, where the
    source's egress policies and the destination's ingress policies both admit it."""
    found = {}
    for source_name, source in sources.items():
        found[source_name] = {}
        for name, destination in destinations.items():
            ports = {
                port_label(port)
                for port in destination["ports"]
                if admitted(objects, "Egress", source, destination, port, destination)
                and admitted(objects, "Ingress", destination, source, port, destination)
            }
            if ports:
                found[source_name][name] = ports
    return found


def test_the_probed_ports_are_every_port_the_endpoints_listen_on():
    """EXPECTED_REACH leaves out what may not be reached: that holds only for probed ports."""
    listening = {
        port_label(port)
        for endpoint in [*OUTSIDE.values(), *pod_endpoints(render("base")).values()]
        for port in endpoint["ports"]
    }
    assert listening == EVERYWHERE


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_is_isolated_for_egress_and_ingress_by_network_policies(target):
    objects = render(target)
    for component, pod in pod_endpoints(objects).items():
        for direction in ("Ingress", "Egress"):
            assert policies_of(objects, pod, direction), f"{component}: nothing limits its {direction}"
    stranger = {"namespace": NAMESPACE, "labels": {"run": "debug"}}
    assert policies_of(objects, stranger, "Egress") and policies_of(objects, stranger, "Ingress")


@pytest.mark.parametrize("target", TARGETS)
def test_each_pod_reaches_only_the_peers_and_ports_its_process_needs(target):
    objects = render(target)
    pods = pod_endpoints(objects)
    found = reach(objects, pods, {**pods, **OUTSIDE})
    found |= reach(objects, {"another-namespace": OUTSIDE["another-namespace"]}, pods)  # in from outside
    assert found == EXPECTED_REACH


@pytest.mark.parametrize("target", TARGETS)
def test_rollout_pods_may_send_only_to_redis_the_judge_proxy_the_learner_and_dns(target):
    """By the rules themselves, not by probing: model-written code and MCP servers run there."""
    objects = render(target)
    pods = pod_endpoints(objects)
    allowed = {"redis", "judge-proxy", "learner"}
    strangers = [{"run": "debug"}, {"app.kubernetes.io/name": "tandem"}]
    dns_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
    rules = [
        rule for policy in policies_of(objects, pods["rollout"], "Egress") for rule in policy["spec"].get("egress", [])
    ]
    assert rules
    for rule in rules:
        assert rule.get("to"), f"a rule to anywhere: {rule}"
        for peer in rule["to"]:
            if peer == dns_peer:
                assert {entry["port"] for entry in rule["ports"]} == {53}, rule
                continue
            assert set(peer) == {"podSelector"}, f"rollout pods reach beyond Tandem's pods: {peer}"
            selected = {c for c, pod in pods.items() if selects(peer["podSelector"], pod["labels"])}
            assert selected and selected <= allowed, peer
            assert not any(selects(peer["podSelector"], labels) for labels in strangers), peer


@pytest.mark.parametrize("target", TARGETS)
def test_only_prometheus_pods_hold_a_service_account_token(target):
    """Prometheus discovers pods through the Kubernetes API; nothing else calls it."""
    for name, workload in workloads(render(target)).items():
        assert pod_spec(workload).get("automountServiceAccountToken") is (name == "tandem-prometheus"), name


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_runs_as_non_root_without_privileges_on_a_read_only_root(target):
    for name, workload in workloads(render(target)).items():
        pod = pod_spec(workload).get("securityContext", {})
        for container in pod_spec(workload)["containers"]:
            own = container.get("securityContext", {})
            effective = {key: own.get(key, pod.get(key)) for key in ("runAsNonRoot", "runAsUser", "seccompProfile")}
            assert effective["runAsNonRoot"] is True and effective["runAsUser"] not in (None, 0), name
            assert effective["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert own.get("allowPrivilegeEscalation") is False and not own.get("privileged"), name
            assert own.get("capabilities") == {"drop": ["ALL"]}, name
            assert own.get("readOnlyRootFilesystem") is True, name


@pytest.mark.parametrize("target", TARGETS)
def test_tandem_processes_write_their_temporary_files_and_caches_to_empty_dirs(target):
    for process, (workload, container) in processes(target).items():
        tmp = volume_of(workload, container, "/tmp")
        assert "emptyDir" in tmp and not tmp["mountReadOnly"], process
    for process in ("rollout", "learner"):
        workload, container = processes(target)[process]
        home = volume_of(workload, container, literal_env(container)["HOME"])
        assert "emptyDir" in home and not home["mountReadOnly"], process


BINARY_UNITS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def bytes_of(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * BINARY_UNITS[unit]


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_requests_cpu_and_memory_and_is_limited_in_memory_but_not_cpu(target):
    for name, workload in workloads(render(target)).items():
        memory_volumes_bytes = sum(
            bytes_of(v["emptyDir"]["sizeLimit"])
            for v in pod_spec(workload).get("volumes", [])
            if v.get("emptyDir", {}).get("medium") == "Memory"
        )
        for container in pod_spec(workload)["containers"]:
            requests, limits = container["resources"]["requests"], container["resources"].get("limits", {})
            assert {"cpu", "memory"} <= set(requests), name
            assert "memory" in limits, f"{name}: no memory limit"
            assert "cpu" not in limits, f"{name}: a CPU limit throttles it while the node has cores to spare"
            assert bytes_of(limits["memory"]) >= bytes_of(requests["memory"]), name
            assert bytes_of(limits["memory"]) > memory_volumes_bytes, f"{name}: /dev/shm alone fills the limit"


def external_redis_overlay(tmp_path: Path, literals: list[str] | None) -> Path:
    """The cpu overlay with components/external-redis, as deploy/k8s/README.md shows it, and
    the ConfigMap naming the server's address when `literals` are given."""
    kustomization = {
        "resources": [os.path.relpath(K8S / "overlays" / "cpu", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "external-redis", tmp_path)],
    }
    if literals is not None:
        kustomization["configMapGenerator"] = [
            {
                "name": "tandem-external-redis",
                "literals": literals,
                "options": {
                    "disableNameSuffixHash": True,
                    "annotations": {"config.kubernetes.io/local-config": "true"},
                },
            }
        ]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return tmp_path


def test_the_external_redis_component_replaces_redis_by_the_address_the_overlay_names(tmp_path):
    objects = build(external_redis_overlay(tmp_path, ["cidr=10.20.0.5/32", "port=6380"]))
    assert not [o for o in objects if o["metadata"]["name"] in ("tandem-redis", "tandem-external-redis")]
    assert len(objects) == len(render("overlays/cpu")) - 3
    assert not schema_errors(objects)
    pods = pod_endpoints(objects)
    server = {"namespace": None, "labels": {}, "ip": "10.20.0.5", "ports": [("", 6380, "TCP"), ("", 6379, "TCP")]}
    neighbour = {**server, "ip": "10.20.0.6"}
    assert {
        name: ports for name, ports in reach(objects, pods, {"server": server, "neighbour": neighbour}).items() if ports
    } == {process: {"server": {6380}} for process in ("api", "judge-proxy", "rollout", "learner")}
    for process, (_, container) in tandem_workloads(objects).items():
        assert "secretKeyRef" in env_entries(container)["TANDEM_REDIS_URL"]["valueFrom"], process


def test_the_external_redis_component_refuses_to_build_without_the_servers_address(tmp_path):
    """Without it the processes' egress would reach no Redis: the build fails, naming what is missing."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(external_redis_overlay(tmp_path, None))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "tandem-external-redis" in result.stderr


def test_the_served_model_overlay_serves_a_model_the_judge_proxy_reaches_and_nothing_else_does():
    objects = render("overlays/served-model")
    assert not schema_errors(objects)
    assert sorted(processes("overlays/served-model")) == sorted(SETTINGS)  # overlays/cpu's processes, once each
    served = workloads(objects)["tandem-served-model"]
    (container,) = pod_spec(served)["containers"]
    args = build_parser().parse_args(container["command"][1:])
    assert args.command == "serve-model" and args.host == "0.0.0.0"
    assert volume_of(served, container, "/models")["mountReadOnly"]
    assert Path(args.dir).parent == Path("/models")

    proxy, proxy_container = processes("overlays/served-model")["judge-proxy"]
    upstreams_file = Path(literal_env(proxy_container)["TANDEM_UPSTREAMS"])
    config_map = of_kind(objects, "ConfigMap")[
        volume_of(proxy, proxy_container, str(upstreams_file.parent))["configMap"]["name"]
    ]
    (upstream,) = yaml.safe_load(config_map["data"][upstreams_file.name])["upstreams"]
    url = urlsplit(upstream["base_url"])
    service = of_kind(objects, "Service")[url.hostname]
    assert service["spec"]["selector"].items() <= served["spec"]["template"]["metadata"]["labels"].items()
    assert url.port == service["spec"]["ports"][0]["port"] == args.port
    assert upstream["model"] == args.name and upstream["structured_output"] is True

    policies = of_kind(objects, "NetworkPolicy")
    own = policies["tandem-served-model"]
    assert own["spec"]["policyTypes"] == ["Ingress", "Egress"] and "egress" not in own["spec"]  # calls nothing
    allowed = {
        c
        for rule in own["spec"]["ingress"]
        for peer in rule["from"]
        for e in peer["podSelector"]["matchExpressions"]
        if e["key"] == "app.kubernetes.io/component"
        for c in e["values"]
    }
    assert allowed == {"judge-proxy", "prometheus"}
    out = policies["tandem-judge-proxy-to-served-model"]["spec"]
    assert out["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "judge-proxy"
    assert out["egress"][0]["ports"] == [{"port": args.port, "protocol": "TCP"}]
