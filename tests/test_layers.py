"""The layers: cluster -> router -> replica -> kernels, and the engine and router cores load no serving stack."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["kernels", "replica", "router", "cluster"]
# Lowest first. A module may import from its own layer or a lower one; the longest prefix names its layer.
LAYERS = ["kernels", "replica.structured_output", "replica.request", "replica.kv_cache", "replica.scheduler",
          "replica.config", "replica.async_engine", "replica.executor", "replica.engine", "replica", "router.messages",
          "router.index", "router.policy", "router.sessions", "router.core", "router.feed", "router", "router.actor",
          "router.follower", "router.serve_router", "cluster"]


def layer_of(module: str) -> int | None:
    matches = [i for i, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + ".")]
    return max(matches, key=lambda i: len(LAYERS[i])) if matches else None


def imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
    return modules


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            own = layer_of(module)
            upward += [f"{module} imports {name}" for name in imported_modules(path)
                       if (layer_of(name) or -1) > own]
    assert upward == []


def test_layer_of_names_the_longest_prefix():
    assert [layer_of(m) for m in ["replica.kv_cache.manager", "replica.async_engine", "router.actor", "json"]] == [
        3, 6, 17, None]


@pytest.mark.parametrize("modules, forbidden", [
    (["replica", "replica.request", "replica.kv_cache", "replica.scheduler", "replica.config", "replica.async_engine"],
     ["ray", "fastapi", "torch"]),
    (["replica.engine"], ["ray", "fastapi"]),
    (["replica.executor.checkpoint", "cluster.ingress"], ["torch"]),  # the ingress only tokenizes
    (["router", "router.index", "router.policy", "router.messages", "router.sessions", "router.core", "router.feed"],
     ["ray", "fastapi", "torch"]),
])
def test_engine_and_router_cores_load_no_serving_stack(modules, forbidden):
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(json.dumps(sorted(m for m in {forbidden!r} if m in sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(loaded.stdout) == []


def test_importing_the_config_creates_no_metrics():
    code = ("import cluster.config, prometheus_client\n"
            "print([m.name for m in prometheus_client.REGISTRY.collect() if 'prefixserve' in m.name])")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
