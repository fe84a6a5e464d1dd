"""Every arrow points down: each package imports only the platform packages on the floors below it, and
the planes outside the control plane (worker, learner) use only the SDK's public modules."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> (its folder, the platform packages it may import); the SDK `echo2` is below them all.
FLOORS = {
    "server": ("server", {"api", "scheduler", "planner", "learner", "tasks"}),
    "scheduler": ("scheduler", {"api", "planner", "learner", "tasks"}),  # its learner host launches learners
    "api": ("api", {"planner", "tasks"}),  # never the compute plane: the control plane runs without torch
    "planner": ("planner", set()),
    "learner": ("learner", {"tasks"}),
    "tasks": ("tasks", set()),
    "echo2_worker": ("workers/echo2_worker", set()),
    "echo2": ("sdk/echo2", set()),
}
PUBLIC_SDK_ONLY = ("learner", "echo2_worker", "tasks")


def imported(folder: str) -> list[tuple[str, str]]:
    """(file, module) for every absolute import in the folder's sources, `from m import n` as m.n."""
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(str(path.relative_to(ROOT)), a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out += [(str(path.relative_to(ROOT)), f"{node.module}.{a.name}") for a in node.names]
    return out


@pytest.mark.parametrize("package", FLOORS)
def test_imports_only_from_the_floors_below(package):
    folder, allowed = FLOORS[package]
    above = set(FLOORS) - allowed - {package, "echo2"}
    wrong = [(f, m) for f, m in imported(folder) if m.split(".")[0] in above]
    assert wrong == [], f"{package} may import only {sorted(allowed) or 'the SDK'} of the platform"


@pytest.mark.parametrize("package", PUBLIC_SDK_ONLY)
def test_uses_only_public_sdk_modules(package):
    folder, _ = FLOORS[package]
    private = [(f, m) for f, m in imported(folder) if m.split(".")[0] == "echo2"
               and any(part.startswith("_") and not part.endswith("__") for part in m.split(".")[1:])]
    assert private == [], "a private SDK module changes without notice; use its public name"


IMPURE = {"sqlalchemy", "celery", "redis", "fastapi", "starlette", "uvicorn", "httpx", "requests", "torch"}


def test_planner_and_its_simulator_are_pure():
    """planner/ (the rules, the solver and the simulator that drives them) takes plain data and returns
    plain data: no database, queue, web or model library, so the control plane, the scheduler and the
    simulator all run the same code."""
    wrong = [(f, m) for f, m in imported("planner") if m.split(".")[0] in IMPURE]
    assert wrong == [], "planner/ stays pure maths"


def test_tasks_need_no_torch():
    """tasks/ is the data plane (prompts, references, rewards, environments): the control plane validates and
    scores with it, so it imports no model library."""
    wrong = [(f, m) for f, m in imported("tasks") if m.split(".")[0] in {"torch", "transformers", "vllm"}]
    assert wrong == [], "tasks/ is imported by the control plane, which runs without torch"


def test_models_are_built_through_the_load_lock():
    """A `from_pretrained`/`from_config` of a causal LM outside echo2.loading races other threads' loads over
    torch's process-wide default device and can leave it at "meta" for every later load in the process."""
    wrong = []
    for folder in ("api", "scheduler", "learner", "workers/echo2_worker", "sdk/echo2", "tasks", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Attribute) and node.attr in {"from_pretrained", "from_config"}
                        and isinstance(node.value, ast.Name) and node.value.id == "AutoModelForCausalLM"
                        and path != ROOT / "sdk/echo2/loading.py"):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert wrong == [], "use echo2.loading.load_causal_lm / causal_lm_from_config"
