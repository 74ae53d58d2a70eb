"""docker-compose.yml and deploy/, read as files: no Docker engine needed.

The compose file is interpolated the way `docker compose config` does it with nothing set:
`${VAR:-default}` becomes its default, `${VAR}` and `${VAR:?message}` the value .env.example
documents. Then each process's environment is checked against its settings class in
services.config, its healthcheck against the port it serves, Prometheus's targets against
the services, and the Grafana dashboards against the datasource and the metrics the code
defines.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic_settings import BaseSettings

from services.config import ApiSettings, JudgeProxySettings, LearnerSettings, RolloutSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GRAFANA = DEPLOY / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))

SETTINGS: dict[str, type[BaseSettings]] = {
    "api": ApiSettings,
    "judge-proxy": JudgeProxySettings,
    "rollout": RolloutSettings,
    "learner": LearnerSettings,
}
"""`tandem <process>` -> the settings class that process reads its environment into."""

REQUIRED_ENV = {
    "api": {"TANDEM_REDIS_URL", "TANDEM_HOST", "TANDEM_PORT"},
    "judge-proxy": {"TANDEM_REDIS_URL", "TANDEM_HOST", "TANDEM_PORT"},
    "rollout": {"TANDEM_REDIS_URL", "TANDEM_METRICS_PORT", "TANDEM_JUDGE_URL"},
    "learner": {"TANDEM_REDIS_URL", "TANDEM_METRICS_PORT", "TANDEM_ADVERTISE_HOST", "TANDEM_WEIGHT_STORE_PORT"},
}
"""What a process needs in a container, where the defaults (127.0.0.1, a free port) fail."""

PROFILES = ("gpu", "cpu")
VARIABLE = re.compile(r"\$\{([^}]*)\}")
VARIABLE_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::?-(.*)|:?\?(.*))?", re.DOTALL)
"""`NAME`, then a `-default` or a `?message` (compose stops with the message when NAME is unset)."""
URL_PORT = re.compile(r"https?://([^/:'\"\s]+):(\d+)(/[^'\"\s]*)?")
METRIC = re.compile(r"\b(?:tandem_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


@functools.cache
def raw_compose() -> dict:
    """docker-compose.yml parsed, YAML anchors and merge keys resolved, not yet interpolated."""
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def string_values(node) -> list[str]:
    if isinstance(node, dict):
        return [s for value in node.values() for s in string_values(value)]
    if isinstance(node, list):
        return [s for item in node for s in string_values(item)]
    return [node] if isinstance(node, str) else []


def variable_uses() -> list[re.Match]:
    """Every `${...}` in docker-compose.yml's values, parsed by VARIABLE_BODY."""
    uses = []
    for body in (b for value in string_values(raw_compose()) for b in VARIABLE.findall(value)):
        match = VARIABLE_BODY.fullmatch(body)
        assert match, (
            f"${{{body}}}: only ${{VAR}}, ${{VAR:-default}}, ${{VAR-default}} and ${{VAR:?message}} are used here"
        )
        uses.append(match)
    return uses


def compose_variables() -> list[tuple[str, str | None]]:
    """(name, default or None) for every `${...}` in docker-compose.yml's values."""
    return [(match.group(1), match.group(2)) for match in variable_uses()]


def interpolate(node, documented: dict[str, str], chosen: dict[str, str] | None = None):
    """Values (not keys) with each variable replaced by the operator's `chosen` value, else its
    default, else its documented value (else empty, as compose does; the .env.example test
    names it)."""
    if isinstance(node, dict):
        return {key: interpolate(value, documented, chosen) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(item, documented, chosen) for item in node]
    if not isinstance(node, str):
        return node

    def value(match: re.Match) -> str:
        name, default, _ = VARIABLE_BODY.fullmatch(match.group(1)).groups()
        if (chosen or {}).get(name):
            return chosen[name]
        return default if default is not None else documented.get(name, "")

    return VARIABLE.sub(value, node)


SECRETS = {
    "GRAFANA_ADMIN_PASSWORD": "pa55word",
    "REDIS_PASSWORD": "s3cret",
    "TANDEM_API_TOKENS": "t0ken:tenant",
    "TANDEM_JUDGE_TOKEN": "t0ken",
}
"""Variables compose requires and no file ships, with sample values an operator would set."""


@functools.cache
def compose() -> dict:
    return interpolate(raw_compose(), read_env_file(ROOT / ".env.example") | SECRETS)


def services() -> dict[str, dict]:
    return compose()["services"]


def process_of(service: dict) -> str | None:
    """The Tandem process a service runs (`tandem <process> ...`), else None."""
    command = service.get("command") or []
    return command[1] if command[:1] == ["tandem"] and command[1] in SETTINGS else None


def tandem_services() -> dict[str, str]:
    """service name -> process, for the services that run a Tandem process."""
    return {name: process_of(s) for name, s in services().items() if process_of(s)}


def environment(service: dict) -> dict[str, str]:
    return {key: str(value) for key, value in (service.get("environment") or {}).items()}


def served_port(service_name: str) -> int:
    """The port the process listens on, as its environment says."""
    env = environment(services()[service_name])
    key = "TANDEM_PORT" if tandem_services()[service_name] in ("api", "judge-proxy") else "TANDEM_METRICS_PORT"
    return int(env[key])


def health_url(service: dict) -> tuple[str, int, str]:
    """(host, port, path) of the URL a service's healthcheck requests."""
    test = service["healthcheck"]["test"]
    match = URL_PORT.search(" ".join(test))
    assert match, f"healthcheck {test} requests no http URL"
    return match.group(1), int(match.group(2)), match.group(3) or "/"


def network_names(name: str) -> set[str]:
    """The names other containers reach a service by: its own and its aliases."""
    networks = services()[name].get("networks") or {}
    return {name, *(alias for network in networks.values() for alias in network.get("aliases", []))}


def active(name: str, profile: str) -> bool:
    profiles = services()[name].get("profiles")
    return not profiles or profile in profiles


def container_port(spec: str) -> int:
    """The container side of a published port, `[address:]host_port:container_port`."""
    return int(spec.rsplit(":", 1)[1])


def mounts(service: dict) -> dict[str, str]:
    """container path -> source, for a service's short-syntax volumes."""
    pairs = (volume.split(":") for volume in service.get("volumes", []))
    return {parts[1]: parts[0] for parts in pairs}


def reserved_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_compose_file_defines_the_stack_and_declares_its_named_volumes():
    assert {
        "redis",
        "api",
        "judge-proxy",
        "rollout-gpu",
        "learner-gpu",
        "rollout-cpu",
        "learner-cpu",
        "prometheus",
        "grafana",
    } <= set(services())
    used = {source for s in services().values() for source in mounts(s).values() if not source.startswith((".", "/"))}
    assert used <= set(compose().get("volumes") or {}), "a named volume is used but not declared"


def test_every_build_names_a_context_and_an_existing_dockerfile():
    builds = {name: s["build"] for name, s in services().items() if "build" in s}
    assert builds
    for name, build in builds.items():
        assert isinstance(build, dict) and {"context", "dockerfile"} <= set(build), name
        assert (ROOT / build["context"]).is_dir(), f"{name}: no build context {build['context']}"
        assert (ROOT / build["context"] / build["dockerfile"]).is_file(), f"{name}: no {build['dockerfile']}"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_copy_only_paths_that_exist_in_the_build_context(dockerfile):
    copies = [
        line.split()[1:-1]
        for line in (DEPLOY / dockerfile).read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
    ]
    assert copies
    for sources in copies:
        for source in sources:
            assert list(ROOT.glob(source)), f"{dockerfile}: COPY {source} matches nothing in the repository"


def base_image_arg(dockerfile: str) -> tuple[str, str]:
    """(ARG name, its default) of the base image a Dockerfile's only FROM names by variable."""
    text = (DEPLOY / dockerfile).read_text()
    assert len(re.findall(r"^FROM ", text, re.MULTILINE)) == 1, f"{dockerfile}: one stage"
    name = re.search(r"^FROM \$\{(\w+)\}$", text, re.MULTILINE).group(1)
    return name, re.search(rf"^ARG {name}=(\S+)$", text, re.MULTILINE).group(1)


def test_cuda_image_is_the_vllm_release_install_sh_installs_and_drops_its_entrypoint():
    pinned = re.search(r"\bvllm==([\d.]+)", (ROOT / "scripts" / "install.sh").read_text()).group(1)
    dockerfile = (DEPLOY / "Dockerfile.cuda").read_text()
    assert base_image_arg("Dockerfile.cuda") == ("VLLM_IMAGE", f"vllm/vllm-openai:v{pinned}")
    assert re.search(r"^ENTRYPOINT \[\]$", dockerfile, re.MULTILINE)
    assert "--no-deps -e ." in dockerfile


def test_cpu_image_installs_with_install_sh_from_the_cpu_torch_index():
    dockerfile = (DEPLOY / "Dockerfile.cpu").read_text()
    assert base_image_arg("Dockerfile.cpu") == ("PYTHON_IMAGE", "python:3.11-slim")
    assert "\nARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\n" in dockerfile
    assert re.search(r"^RUN scripts/install\.sh ", dockerfile, re.MULTILINE)


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_no_dockerfile_needs_a_frontend_image_from_a_registry(dockerfile):
    # `# syntax=` makes BuildKit pull that frontend before building: no build without a registry.
    assert not (DEPLOY / dockerfile).read_text().startswith("# syntax=")


def test_every_image_is_a_variable_defaulting_to_the_upstream_image():
    raw = raw_compose()["services"]
    pulled = {name: s["image"] for name, s in raw.items() if "build" not in s}
    assert set(pulled) == {"redis", "prometheus", "grafana"}
    upstream = {"redis": "redis:7.4", "prometheus": "prom/prometheus:v3.5.0", "grafana": "grafana/grafana:12.1.0"}
    for name, image in pulled.items():
        match = re.fullmatch(r"\$\{(\w+):-([^}]+)\}", image)
        assert match and match.group(2) == upstream[name], f"{name}: image {image!r}"
    # Each build passes its Dockerfile's base image ARG from a variable with the same default.
    for name, service in raw.items():
        if "build" in service:
            arg, default = base_image_arg(Path(service["build"]["dockerfile"]).name)
            match = re.fullmatch(r"\$\{(\w+):-([^}]+)\}", service["build"]["args"][arg])
            assert match and match.group(2) == default, f"{name}: build arg {arg}"


def test_the_offline_images_replace_only_what_compose_names_by_variable():
    script = (ROOT / "scripts" / "offline_images.sh").read_text()
    written = set(re.findall(r"^(\w+)=\$\w+$", script, re.MULTILINE))
    assert written == {"TANDEM_PYTHON_IMAGE", "REDIS_IMAGE", "PROMETHEUS_IMAGE", "TANDEM_IMAGE_TAG"}
    assert written <= {name for name, _ in compose_variables()}
    offline = sorted((DEPLOY / "offline").glob("*.Dockerfile"))
    assert [d.name for d in offline] == ["prometheus.Dockerfile", "python.Dockerfile", "redis.Dockerfile"]
    for dockerfile in offline:  # each on the debootstrapped base the script names
        assert "\nFROM ${DEBIAN_IMAGE}\n" in dockerfile.read_text(), dockerfile.name


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_runs_every_tandem_process_once(profile):
    running = sorted(process for name, process in tandem_services().items() if active(name, profile))
    assert running == sorted(SETTINGS)


@pytest.mark.parametrize("service", sorted(tandem_services()))
def test_tandem_service_sets_what_its_process_needs_in_a_container(service):
    process = tandem_services()[service]
    env = environment(services()[service])
    assert REQUIRED_ENV[process] <= set(env), f"{service} lacks {REQUIRED_ENV[process] - set(env)}"
    if "TANDEM_HOST" in REQUIRED_ENV[process]:
        assert env["TANDEM_HOST"] == "0.0.0.0", "127.0.0.1 is unreachable from other containers"
    if process == "learner":
        assert "--resume" in services()[service]["command"], "a restarted learner must continue its job"


@pytest.mark.parametrize("service", sorted(tandem_services()))
def test_tandem_variables_are_fields_of_the_process_settings_and_validate(service):
    settings_class = SETTINGS[tandem_services()[service]]
    env = environment(services()[service])
    values = {key.removeprefix("TANDEM_").lower(): value for key, value in env.items() if key.startswith("TANDEM_")}
    unknown = set(values) - set(settings_class.model_fields)
    assert not unknown, f"{service}: {settings_class.__name__} has no field for {sorted(unknown)}"
    settings_class(**values)


def test_redis_url_names_the_redis_service():
    for name in tandem_services():
        url = urlsplit(environment(services()[name])["TANDEM_REDIS_URL"])
        assert url.scheme == "redis" and url.port == 6379, name
        assert services()[url.hostname]["image"].startswith("redis:"), f"{name}: {url.hostname} is not redis"


def test_redis_requires_the_password_every_process_and_the_healthcheck_present():
    """REDIS_PASSWORD set to a sample value: the server requires it, each URL carries it."""
    stack = interpolate(raw_compose(), read_env_file(ROOT / ".env.example") | {"REDIS_PASSWORD": "s3cret"})
    redis = stack["services"]["redis"]
    assert "--requirepass s3cret" in " ".join(redis["command"])
    assert environment(redis)["REDISCLI_AUTH"] == "s3cret", "redis-cli ping would be refused"
    for name in tandem_services():
        assert urlsplit(environment(stack["services"][name])["TANDEM_REDIS_URL"]).password == "s3cret", name


def test_judge_url_names_the_judge_proxy_and_its_port():
    for name, process in tandem_services().items():
        if process == "rollout":
            url = urlsplit(environment(services()[name])["TANDEM_JUDGE_URL"])
            assert tandem_services().get(url.hostname) == "judge-proxy", name
            assert url.port == served_port(url.hostname), name


def test_learner_advertises_a_name_it_answers_to_and_exposes_the_rendezvous_port():
    for name, process in tandem_services().items():
        if process == "learner":
            env = environment(services()[name])
            assert env["TANDEM_ADVERTISE_HOST"] in network_names(name)
            port = int(env["TANDEM_WEIGHT_STORE_PORT"])
            assert port != 0, "rollout servers cannot find a random port"
            assert str(port) in [str(p) for p in services()[name].get("expose", [])]


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_gives_its_rollout_server_and_learner_the_shared_names(profile):
    for process in ("rollout", "learner"):
        names = [name for name, p in tandem_services().items() if p == process and active(name, profile)]
        assert len(names) == 1 and process in network_names(names[0]), (profile, process, names)


def test_rollout_and_learner_read_models_from_one_mount_and_the_learner_keeps_runs_on_a_volume():
    for name, process in tandem_services().items():
        if process in ("rollout", "learner"):
            assert mounts(services()[name]).get("/models") == "./models", name
        if process == "learner":
            runs_dir = environment(services()[name])["TANDEM_RUNS_DIR"]
            assert mounts(services()[name])[runs_dir] in compose()["volumes"]


def test_the_api_sees_the_folders_it_confines_tenants_to_as_the_learner_and_rollout_servers_do():
    """Symlinks are resolved where the API checks a path: it must see the same files."""
    api = services()["api"]
    roots = ApiSettings(**{k.removeprefix("TANDEM_").lower(): v for k, v in environment(api).items()}).path_roots
    for root in roots.split(","):
        assert f"{mounts(api).get(root)}:{root}:ro" in api["volumes"], f"the API does not see {root} read-only"
        for name, process in tandem_services().items():
            if process in ("rollout", "learner"):
                assert mounts(services()[name]).get(root) == mounts(api)[root], (name, root)


def test_redis_persists_an_append_only_file_on_a_volume():
    redis = services()["redis"]
    assert "--appendonly yes" in " ".join(redis["command"])
    assert mounts(redis).get("/data") in compose()["volumes"]
    assert redis["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -q PONG"]


@pytest.mark.parametrize("service", sorted(tandem_services()))
def test_healthcheck_probes_healthz_on_the_port_the_process_serves(service):
    host, port, path = health_url(services()[service])
    assert host in ("127.0.0.1", "localhost")
    assert (port, path) == (served_port(service), "/healthz")


def test_published_ports_are_the_ports_the_healthchecks_probe():
    published = {name: s["ports"] for name, s in services().items() if s.get("ports")}
    assert {"api", "judge-proxy", "prometheus", "grafana"} <= set(published)
    for name, ports in published.items():
        assert {container_port(p) for p in ports} == {health_url(services()[name])[1]}, name


MONITORING = ("prometheus", "grafana")
"""Services with no authentication of their own (Prometheus) or an anonymous viewer (Grafana)."""


def published_addresses(chosen: dict[str, str]) -> dict[str, set[str]]:
    """service -> the host addresses its ports bind to, with the operator's `chosen` variables."""
    rendered = interpolate(raw_compose(), read_env_file(ROOT / ".env.example") | SECRETS, chosen)
    return {
        name: {spec.rsplit(":", 2)[0] for spec in service["ports"]}
        for name, service in rendered["services"].items()
        if service.get("ports")
    }


def test_publishing_the_api_leaves_prometheus_and_grafana_on_loopback():
    published = published_addresses({"TANDEM_PUBLISH_ADDRESS": "0.0.0.0"})
    assert published["api"] == published["judge-proxy"] == {"0.0.0.0"}
    assert all(published[name] == {"127.0.0.1"} for name in MONITORING), published


def test_prometheus_and_grafana_are_published_by_their_own_variable_only():
    assert all(addresses == {"127.0.0.1"} for addresses in published_addresses({}).values())
    published = published_addresses({"TANDEM_MONITORING_ADDRESS": "0.0.0.0"})
    assert {name: published[name] for name in MONITORING} == {name: {"0.0.0.0"} for name in MONITORING}
    assert published["api"] == published["judge-proxy"] == {"127.0.0.1"}


def test_grafana_lets_anonymous_viewers_in_only_when_the_operator_opts_in():
    def grafana(chosen: dict[str, str]) -> dict[str, str]:
        rendered = interpolate(raw_compose(), read_env_file(ROOT / ".env.example") | SECRETS, chosen)
        return environment(rendered["services"]["grafana"])

    assert grafana({})["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    opted_in = grafana({"GRAFANA_ANONYMOUS": "true"})
    assert (opted_in["GF_AUTH_ANONYMOUS_ENABLED"], opted_in["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == ("true", "Viewer")


def test_every_service_with_an_http_endpoint_has_a_healthcheck():
    for name in [*tandem_services(), "prometheus", "grafana"]:
        assert health_url(services()[name])


def test_depends_on_waits_for_healthy_services_that_run_in_the_same_profiles():
    edges = 0
    for name, service in services().items():
        for target, spec in (service.get("depends_on") or {}).items():
            edges += 1
            assert isinstance(spec, dict) and spec["condition"] == "service_healthy", f"{name} -> {target}"
            assert "healthcheck" in services()[target], f"{name} waits for {target}, which has no healthcheck"
            for profile in PROFILES:
                assert not active(name, profile) or active(target, profile), f"{name} -> {target} in {profile}"
    assert edges >= len(tandem_services()) + 2


def test_every_compose_variable_is_documented_in_env_example_with_the_same_default():
    documented = read_env_file(ROOT / ".env.example")
    assert documented["COMPOSE_PROFILES"] in PROFILES
    for name, default in compose_variables():
        assert name in documented, f"${{{name}}} is not in .env.example"
        if default is not None:
            assert documented[name] == default, f"{name}: .env.example says {documented[name]!r}, compose {default!r}"


@pytest.mark.parametrize("password", sorted(SECRETS))
def test_no_secret_ships_compose_refuses_to_start_until_one_is_set(password):
    uses = [match for match in variable_uses() if match.group(1) == password]
    assert uses and all(match.group(3) for match in uses), f"every use must be ${{{password}:?message}}"
    assert read_env_file(ROOT / ".env.example")[password] == "", ".env.example must leave it empty"


def test_dot_env_is_the_operators_own_and_never_tracked():
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert tracked.stdout == "", ".env holds an operator's secrets: only .env.example is tracked"
    assert (
        ".env" in (ROOT / ".gitignore").read_text().split() and ".env" in (ROOT / ".dockerignore").read_text().split()
    )


def test_env_example_selects_a_profile_that_exists():
    selected = read_env_file(ROOT / ".env.example")["COMPOSE_PROFILES"]
    assert any(selected in (s.get("profiles") or []) for s in services().values())


@pytest.mark.parametrize("profile", PROFILES)
def test_gpu_services_reserve_nvidia_gpus_and_cpu_services_none(profile):
    profiled = {name: s for name, s in services().items() if profile in (s.get("profiles") or [])}
    assert sorted(tandem_services().get(name, name) for name in profiled) == ["learner", "rollout"]
    for name, service in profiled.items():
        devices = reserved_devices(service)
        if profile == "gpu":
            assert devices, f"{name} reserves no GPU"
            for device in devices:
                assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
                assert "count" in device or "device_ids" in device, name
            assert service["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        else:
            assert not devices, f"{name} reserves devices in the cpu profile"
            assert service["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
    unprofiled_devices = [n for n, s in services().items() if not s.get("profiles") and reserved_devices(s)]
    assert not unprofiled_devices


def prometheus_config() -> dict:
    return yaml.safe_load((DEPLOY / "prometheus.yml").read_text())


def scrape_targets() -> set[tuple[str, int, str]]:
    """(host, port, job name) of every static or DNS target in prometheus.yml."""
    targets = set()
    for job in prometheus_config()["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets.add((host, int(port), job["job_name"]))
        for dns in job.get("dns_sd_configs", []):
            assert dns.get("type", "SRV") == "A"
            targets |= {(host, int(dns["port"]), job["job_name"]) for host in dns["names"]}
    return targets


@pytest.mark.parametrize("service", sorted(tandem_services()))
def test_prometheus_scrapes_the_process_under_a_job_named_after_it(service):
    port, process = served_port(service), tandem_services()[service]
    assert any(host in network_names(service) and p == port and job == process for host, p, job in scrape_targets()), (
        f"no scrape target for {service} on port {port}"
    )


def test_prometheus_keeps_tandems_job_label_and_scrapes_every_5s():
    config = prometheus_config()
    assert config["global"]["scrape_interval"] == "5s"
    assert all(job.get("honor_labels") is True for job in config["scrape_configs"]), (
        "without honor_labels the dashboards' job label becomes exported_job"
    )
    prometheus = services()["prometheus"]
    config_path = next(arg.split("=", 1)[1] for arg in prometheus["command"] if arg.startswith("--config.file="))
    assert mounts(prometheus)[config_path] == "./deploy/prometheus.yml"


def datasource() -> dict:
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = provisioned["datasources"]
    return source


def test_grafana_datasource_is_the_prometheus_service_at_its_scrape_interval():
    source = datasource()
    url = urlsplit(source["url"])
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    assert url.hostname in network_names("prometheus")
    assert url.port == health_url(services()["prometheus"])[1]
    assert source["jsonData"]["timeInterval"] == prometheus_config()["global"]["scrape_interval"]


def test_grafana_mounts_the_provisioning_and_the_folder_the_dashboard_provider_reads():
    grafana = mounts(services()["grafana"])
    assert grafana["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tandem.yaml").read_text())
    (entry,) = provider["providers"]
    assert grafana[entry["options"]["path"]] == "./deploy/grafana/dashboards"
    home = environment(services()["grafana"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (GRAFANA / "dashboards" / Path(home).relative_to(entry["options"]["path"])).is_file()


def datasource_refs(node) -> list:
    """Every `datasource` value anywhere in a dashboard (panels, targets, variables, rows)."""
    if isinstance(node, dict):
        found = [node["datasource"]] if "datasource" in node else []
        return found + [ref for value in node.values() for ref in datasource_refs(value)]
    if isinstance(node, list):
        return [ref for item in node for ref in datasource_refs(item)]
    return []


def expressions(dashboard: dict) -> list[str]:
    panels = [p for panel in dashboard["panels"] for p in [panel, *panel.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    return exprs + [v["definition"] for v in dashboard.get("templating", {}).get("list", []) if v["type"] == "query"]


def test_the_four_dashboards_exist_with_unique_uids():
    assert sorted(p.stem for p in DASHBOARDS) == ["judge", "queues", "rollout", "training"]
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARDS]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_dashboard_query_uses_the_provisioned_datasource_uid(path):
    dashboard = json.loads(path.read_text())
    refs = datasource_refs(dashboard)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and len(refs) >= 2 * len(panels)
    assert all(isinstance(ref, dict) and ref["uid"] == datasource()["uid"] for ref in refs), path.name


@functools.cache
def defined_metrics() -> set[str]:
    """Metric names the code registers: string literals in Tandem's packages and vLLM's metrics."""
    packages = ("services", "rollout", "learner", "judge_proxy")
    sources = [path for package in packages for path in (ROOT / package).rglob("*.py")]
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed")
    sources += list(Path(spec.submodule_search_locations[0], "v1", "metrics").rglob("*.py"))
    literal = re.compile(r"[\"']((?:tandem_|vllm:)[a-z0-9_:]+)[\"']")
    return {name for path in sources for name in literal.findall(path.read_text())}


def base_names(metric: str) -> set[str]:
    """The names a series may be registered under (histogram parts; counters with and without _total)."""
    base = re.sub(r"_(bucket|sum|count)$", "", metric)
    return {base, base.removesuffix("_total")}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_metrics_are_registered_by_tandem_or_vllm(path):
    used = {m for expr in expressions(json.loads(path.read_text())) for m in METRIC.findall(expr)}
    assert used
    unknown = sorted(m for m in used if not base_names(m) & defined_metrics())
    assert not unknown, f"{path.name} queries metrics no code registers: {unknown}"


DASHBOARD_TOPICS = {
    "training": [
        "reward_mean",
        "loss",
        "mismatch_kl",
        "grad_norm",
        "importance_weight_mean",
        "staleness",
        "seconds_since_progress",
        "job_paused",
    ],
    "rollout": [
        "generated_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "episode_seconds",
        "weight_sync_seconds",
    ],
    "judge": [
        "tokens_total",
        "budget_tokens_per_minute",
        "queue_wait_seconds",
        "upstream_429_total",
        "upstream_state",
        "model_available",
    ],
    "queues": ["queue_depth", "queue_pending", "queue_dead_letters"],
}
"""What issues 6 and 48 ask each dashboard to show, as metric-name fragments."""


@pytest.mark.parametrize("name", sorted(DASHBOARD_TOPICS))
def test_each_dashboard_shows_what_it_is_for(name):
    text = "\n".join(expressions(json.loads((GRAFANA / "dashboards" / f"{name}.json").read_text())))
    missing = [topic for topic in DASHBOARD_TOPICS[name] if topic not in text]
    assert not missing


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus's checker) is not installed")
def test_dashboard_expressions_and_prometheus_config_pass_promtool(tmp_path):
    grafana_variables = {"$__rate_interval": "20s", "$__range": "1h", "$job": ".*", "$upstream": ".*"}
    rules = []
    for path in DASHBOARDS:
        for expr in expressions(json.loads(path.read_text())):
            if expr.startswith("label_values("):
                continue
            for variable, value in grafana_variables.items():
                expr = expr.replace(variable, value)
            rules.append({"record": f"dashboard:{path.stem}:{len(rules)}", "expr": expr})
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    for args in (["check", "rules", str(tmp_path / "rules.yml")], ["check", "config", str(DEPLOY / "prometheus.yml")]):
        result = subprocess.run(["promtool", *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_stand_in_provider_matches_the_upstreams_file_that_names_it():
    """Profile `stand-in`: the stand-in serves the model the judge-bound job asks for, on the
    port and with the limits its upstreams file gives the judge proxy."""
    service = services()["stand-in"]
    assert "stand-in" in service["profiles"] and not set(service["profiles"]) & set(PROFILES)
    command = service["command"]
    flags = dict(zip(command[3::2], command[4::2]))
    upstream = yaml.safe_load((ROOT / "deploy" / "configs" / "judge_upstreams.stand-in.yaml").read_text())["upstreams"]
    assert len(upstream) == 1 and "--latency" in command
    assert upstream[0]["base_url"] == f"http://stand-in:{flags['--port']}/v1"
    assert (upstream[0]["model"], str(upstream[0]["tpm"]), str(upstream[0]["rpm"])) == (
        flags["--model"],
        flags["--tpm"],
        flags["--rpm"],
    )
    assert health_url(service)[1] == int(flags["--port"])


def test_the_served_model_is_the_upstream_its_upstreams_file_names_and_reads_models_read_only():
    """Profile `served-model`: `tandem serve-model` on a folder of the models mount, answering
    to the model name, host and port the judge proxy's upstreams file gives it."""
    from tandem.cli import build_parser

    service = services()["served-model"]
    assert "served-model" in service["profiles"] and not set(service["profiles"]) & set(PROFILES)
    command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in service["command"]]
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve-model" and args.host == "0.0.0.0" and args.dir.startswith("/models/")
    assert any(v.endswith(":/models:ro") for v in service["volumes"])
    (upstream,) = yaml.safe_load((ROOT / "deploy" / "configs" / "judge_upstreams.served-model.yaml").read_text())[
        "upstreams"
    ]
    assert upstream["base_url"] == f"http://served-model:{args.port}/v1"
    assert upstream["model"] == args.name and upstream["structured_output"] is True
    assert health_url(service)[1] == args.port
