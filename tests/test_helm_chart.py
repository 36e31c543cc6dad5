"""The Helm chart, checked offline: lint, render, validate what it renders."""
import importlib
import json
import re
import warnings
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from cluster.app import ingress_options
from cluster.autoscaling import AutoscalingSettings, PolicyKwargs
from cluster.config import ClusterConfig, IngressAutoscaling
from cluster.direct_ingress import DIRECT_INGRESS_ENV
from replica.config import CacheConfig, EngineConfig
from replica.scheduler import SchedulerConfig

CHART = Path(__file__).parents[1] / "helm" / "prefixserve"
SCHEMA = json.loads((Path(__file__).parent / "schemas" / "rayservice.schema.json").read_text())
VALUES_FILES = ["values.yaml", "values-gpu.yaml", "values-cpu-small.yaml"]
KUBE_VERSION = "1.30.0"
CRD_GROUPS = ("ray.io/", "monitoring.coreos.com/")   # no offline schema: checked by the tests below
RELEASE, NAMESPACE = "demo", "llm"


@pytest.fixture(scope="module")
def chart():
    return helm_python.Chart.load(CHART)


def values_of(values_file: str) -> dict:
    return yaml.safe_load((CHART / values_file).read_text())


def render(chart, values: dict | None = None) -> dict[str, dict]:
    """Rendered manifests by kind (one object per kind here), NOTES.txt under "NOTES"."""
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = {"NOTES": rendered.pop("prefixserve/templates/NOTES.txt")}
    for manifest in rendered.values():
        for obj in yaml.safe_load_all(manifest):
            if obj:
                assert obj["kind"] not in objects, f"two {obj['kind']} objects"
                objects[obj["kind"]] = obj
    return objects


def ray_containers(rayservice: dict) -> list[dict]:
    return [container for template in pod_templates(rayservice) for container in template["spec"]["containers"]]


def pod_templates(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [group["template"] for group in cluster["workerGroupSpecs"]]


def serve_application(rayservice: dict) -> dict:
    (application,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return application


@pytest.fixture(scope="module", params=VALUES_FILES)
def rendered(request, chart):
    return request.param, render(chart, values_of(request.param))


def test_lint_is_clean_in_strict_mode(rendered):
    values_file, _ = rendered
    report = helm_python.lint(CHART, values_of(values_file), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]   # warnings and errors
    assert (problems, report["errors"]) == ([], [])


def validate_core_objects(objects: dict[str, dict]) -> None:
    for kind, obj in objects.items():
        if kind != "NOTES" and not obj["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_core_objects_and_pod_templates_are_valid_kubernetes(rendered):
    _, objects = rendered
    validate_core_objects(objects)
    templates = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"ray-{i}"}, "template": t}
                 for i, t in enumerate(pod_templates(objects["RayService"]))]
    for template in templates:
        kubernetes_validate.validate(template, KUBE_VERSION, strict=True)


def test_rayservice_matches_the_schema_and_worker_bounds(rendered):
    _, objects = rendered
    rayservice = objects["RayService"]
    jsonschema.validate(rayservice, SCHEMA)
    for group in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_serve_config_is_a_valid_serve_deploy_config(rendered):
    _, objects = rendered
    config = yaml.safe_load(objects["RayService"]["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    application = serve_application(objects["RayService"])
    assert (application["name"], application["route_prefix"], application["import_path"]) == (
        "prefixserve", "/", "cluster.app:build_app")
    assert "api_key" not in application["args"]   # only ever from the Secret, as PREFIXSERVE_API_KEY


def unknown_autoscaling_keys(application: dict) -> set[str]:
    """autoscaling_config keys that are no AutoscalingConfig field (Serve ignores them silently)."""
    configs = [d["autoscaling_config"] for d in application.get("deployments", []) if "autoscaling_config" in d]
    return {key for config in configs for key in config} - set(AutoscalingConfig.model_fields)


def test_autoscaling_args_build_a_real_autoscaling_config(rendered):
    _, objects = rendered
    application = serve_application(objects["RayService"])
    settings = AutoscalingSettings(**application["args"]["autoscaling"])   # unknown keys rejected
    serve_config = settings.to_serve_config()
    assert set(serve_config) <= set(AutoscalingConfig.model_fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # metrics_interval_s, on purpose
        AutoscalingConfig(**serve_config)
    assert unknown_autoscaling_keys(application) == set()


def test_ingress_autoscaling_args_build_a_real_autoscaling_config(chart):
    values = {"serve": {"args": {"ingress_replicas": 2, "ingress_autoscaling": {"max_replicas": 3}}}}
    args = serve_application(render(chart, values)["RayService"])["args"]
    serve_config = ingress_options(ClusterConfig(**args))["autoscaling_config"]
    assert "Ingress replicas autoscale between 1 and 3 on their ongoing requests" in render(chart, values)["NOTES"]
    assert "Ingress replicas" not in render(chart)["NOTES"]
    assert AutoscalingConfig(**serve_config).model_dump(include=set(serve_config)) == {
        "min_replicas": 1, "max_replicas": 3, "initial_replicas": 2, "target_ongoing_requests": 16.0,
        "upscale_delay_s": 30.0, "downscale_delay_s": 600.0}


def test_camel_case_autoscaling_override_is_caught(chart):
    override = {"name": "Engine", "autoscaling_config": {"min_replicas": 1, "maxReplicas": 3}}
    objects = render(chart, {"serve": {"deployments": [override]}})
    application = serve_application(objects["RayService"])
    ServeDeploySchema.model_validate({"applications": [application]})   # Serve itself lets it through
    assert unknown_autoscaling_keys(application) == {"maxReplicas"}


def test_cluster_config_accepts_the_args(rendered):
    _, objects = rendered
    ClusterConfig(**serve_application(objects["RayService"])["args"])


def test_values_schema_rejects_misspelt_values(chart):
    with pytest.raises(helm_python.HelmValuesError, match="additional properties 'min_replica' not allowed"):
        render(chart, {"serve": {"args": {"autoscaling": {"min_replica": 2}}}})
    with pytest.raises(helm_python.HelmValuesError, match="additional properties 'maxReplica' not allowed"):
        render(chart, {"workerGroups": [{"name": "cpu", "replicas": 1, "minReplicas": 1, "maxReplica": 2}]})
    with pytest.raises(helm_python.HelmValuesError, match="/model/source"):
        render(chart, {"model": {"source": "s3"}})


def test_values_schema_knows_exactly_the_python_config_fields(chart):
    args = chart.schema["properties"]["serve"]["properties"]["args"]["properties"]
    engine, autoscaling = args["engine"]["properties"], args["autoscaling"]["properties"]
    assert set(engine) == set(EngineConfig.model_fields) - {"model"}
    assert set(engine["scheduler"]["properties"]) == set(SchedulerConfig.model_fields) - {"max_model_len"}
    assert set(engine["cache"]["properties"]) == set(CacheConfig.model_fields)
    assert set(autoscaling) == set(AutoscalingSettings.model_fields)
    assert set(autoscaling["policy_kwargs"]["properties"]) == set(PolicyKwargs.model_fields)
    assert set(args["ingress_autoscaling"]["properties"]) == set(IngressAutoscaling.model_fields)
    assert set(args) == set(ClusterConfig.model_fields) - {"api_key"}


def test_null_autoscaling_runs_a_fixed_replica_count(chart):
    args = serve_application(render(chart, {"serve": {"args": {"autoscaling": None}}})["RayService"])["args"]
    assert "autoscaling" not in args and args["num_replicas"] == 2


def test_args_default_to_the_python_defaults(chart):
    args = dict(chart.values["serve"]["args"])
    autoscaling = args.pop("autoscaling")
    assert ClusterConfig(**args) == ClusterConfig()
    assert AutoscalingSettings(**autoscaling) == AutoscalingSettings()   # the chart autoscales by default


def test_policy_import_path_imports():
    settings = AutoscalingSettings().to_serve_config()
    module, name = settings["policy"]["policy_function"].split(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_app_import_path_imports(chart):
    module, name = "cluster.app:build_app".split(":")
    assert serve_application(render(chart)["RayService"])["import_path"] == f"{module}:{name}"
    assert callable(getattr(importlib.import_module(module), name))


def test_missing_required_value_fails_rendering(chart):
    # helm lint passes these values: only rendering evaluates `required`.
    with pytest.raises(helm_python.HelmRenderError, match="model.pvc.claimName is required"):
        render(chart, {"model": {"source": "pvc"}})
    with pytest.raises(helm_python.HelmRenderError, match="model.uri is required"):
        render(chart, {"model": {"source": "uri"}})


def model_volumes(rayservice: dict) -> list[tuple[list, list]]:
    return [([v for v in t["spec"]["volumes"] if v["name"] == "model"],
             [m for c in t["spec"]["containers"] for m in c["volumeMounts"] if m["name"] == "model"])
            for t in pod_templates(rayservice)]


def test_default_model_comes_from_the_image(chart):
    rayservice = render(chart)["RayService"]
    assert "model" not in serve_application(rayservice)["args"]["engine"]
    assert model_volumes(rayservice) == [([], []), ([], [])]


def test_model_from_a_pvc_is_mounted_read_only_in_every_ray_pod(chart):
    values = {"model": {"source": "pvc", "path": "llama", "pvc": {"claimName": "weights", "subPath": "hf"}}}
    rayservice = render(chart, values)["RayService"]
    assert serve_application(rayservice)["args"]["engine"]["model"] == "/models/llama"
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    mount = {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "hf"}
    assert model_volumes(rayservice) == [([volume], [mount])] * 2


def test_model_from_a_uri_is_downloaded_by_an_init_container(chart):
    uri = "https://example.com/models/SmolLM2-360M-Instruct.Q8_0.gguf"
    rayservice = render(chart, {"model": {"source": "uri", "uri": uri}})["RayService"]
    model_file = "/models/SmolLM2-360M-Instruct.Q8_0.gguf"
    assert serve_application(rayservice)["args"]["engine"]["model"] == model_file
    for template in pod_templates(rayservice):
        (download,) = template["spec"]["initContainers"]
        assert {e["name"]: e["value"] for e in download["env"]} == {"MODEL_URI": uri, "MODEL_FILE": model_file}
        assert download["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    assert model_volumes(rayservice) == [([{"name": "model", "emptyDir": {"sizeLimit": "20Gi"}}],
                                          [{"name": "model", "mountPath": "/models", "readOnly": True}])] * 2


def api_key_env(rayservice: dict) -> list:
    return [[e for e in c.get("env", []) if e["name"] == "PREFIXSERVE_API_KEY"] for c in ray_containers(rayservice)]


def test_api_key_from_an_existing_secret_reaches_every_ray_container(chart):
    objects = render(chart, {"apiKey": {"existingSecret": "llm-keys", "secretKey": "prefixserve"}})
    env = {"name": "PREFIXSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-keys", "key": "prefixserve"}}}
    assert api_key_env(objects["RayService"]) == [[env], [env]]
    assert "Secret" not in objects


def test_the_direct_front_door_turns_serves_haproxy_mode_on_in_every_ray_container(chart):
    objects = render(chart, {"serve": {"args": {"front_door": "direct"}}})
    assert serve_application(objects["RayService"])["args"]["front_door"] == "direct"
    envs = [{e["name"]: e["value"] for e in c.get("env", [])} for c in ray_containers(objects["RayService"])]
    assert envs == [DIRECT_INGRESS_ENV, DIRECT_INGRESS_ENV]
    default = render(chart, {})["RayService"]
    assert [c.get("env", []) for c in ray_containers(default)] == [[], []]


def test_api_key_value_is_stored_in_a_secret_of_the_chart(chart):
    objects = render(chart, {"apiKey": {"value": "sk-test"}})
    validate_core_objects(objects)
    secret = objects["Secret"]
    assert (secret["metadata"]["name"], secret["data"]) == ("demo-prefixserve-api-key", {"api-key": "c2stdGVzdA=="})
    env = {"name": "PREFIXSERVE_API_KEY",
           "valueFrom": {"secretKeyRef": {"name": "demo-prefixserve-api-key", "key": "api-key"}}}
    assert api_key_env(objects["RayService"]) == [[env], [env]]


def test_without_an_api_key_the_notes_warn(chart):
    objects = render(chart)
    assert api_key_env(objects["RayService"]) == [[], []]
    assert "WARNING: no API key is set" in objects["NOTES"]
    assert "kubectl -n llm port-forward svc/demo-prefixserve-serve-svc 8000:8000" in objects["NOTES"]


def test_workers_are_ready_when_the_app_answers_health_and_the_head_keeps_kuberay_probes(chart):
    head, worker = ray_containers(render(chart)["RayService"])
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "serve"}
    assert "readinessProbe" not in head and "livenessProbe" not in head


def test_gpu_values_schedule_one_replica_per_gpu(chart):
    rayservice = render(chart, values_of("values-gpu.yaml"))["RayService"]
    args = serve_application(rayservice)["args"]
    (gpu_group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (worker,) = gpu_group["template"]["spec"]["containers"]
    assert (args["replica_num_gpus"], worker["resources"]["limits"]["nvidia.com/gpu"]) == (1.0, "1")
    assert gpu_group["maxReplicas"] >= args["autoscaling"]["max_replicas"]
    assert gpu_group["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_a_tensor_parallel_replica_takes_a_gpu_group_pod_with_its_gpus(chart):
    values = values_of("values-gpu.yaml")
    values["serve"]["args"].update(replica_num_gpus=2.0, engine={"tensor_parallel_size": 2})
    with pytest.raises(helm_python.HelmRenderError, match="a replica takes 2 GPUs on one node .* no worker group's "
                                                          "pods have more than 1 nvidia.com/gpu"):
        render(chart, values)
    (gpu_group,) = values["workerGroups"]
    gpu_group["resources"] = {"requests": {"cpu": "12", "nvidia.com/gpu": "2"},
                              "limits": {"cpu": "12", "nvidia.com/gpu": "2"}}
    args = serve_application(render(chart, values)["RayService"])["args"]
    config = ClusterConfig.model_validate(args)
    assert (config.engine.tensor_parallel_size, config.replica_num_gpus, config.placement_strategy) == (
        2, 2.0, "STRICT_PACK")
    values["serve"]["args"]["placement_strategy"] = "SPREAD"  # ranks on any nodes: a GPU per pod is enough
    gpu_group["resources"]["requests"]["nvidia.com/gpu"] = gpu_group["resources"]["limits"]["nvidia.com/gpu"] = "1"
    render(chart, values)


def test_monitoring_is_off_by_default(chart):
    assert set(render(chart)) == {"NOTES", "RayService"}


def test_monitoring_scrapes_app_metrics_on_the_head_and_ray_metrics_everywhere(chart):
    objects = render(chart, values_of("values-gpu.yaml"))
    service, monitor = objects["Service"], objects["ServiceMonitor"]
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "prefixserve",
                                           "app.kubernetes.io/instance": "demo", "ray.io/node-type": "head"}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "serve", "path": "/metrics", "interval": "15s"}]
    assert objects["PodMonitor"]["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "interval": "15s"}]
    for template in pod_templates(objects["RayService"]):
        selector = objects["PodMonitor"]["spec"]["selector"]["matchLabels"]
        assert template["metadata"]["labels"].items() >= selector.items()
    assert objects["ConfigMap"]["metadata"]["labels"]["grafana_dashboard"] == "1"


DASHBOARD_METRICS = {
    "prefixserve:time_to_first_token_seconds_bucket", "prefixserve:inter_token_latency_seconds_bucket",
    "prefixserve:generation_tokens_total", "prefixserve:kv_cache_usage_perc",
    "prefixserve:prefix_cache_hits_total", "prefixserve:prefix_cache_queries_total",
    "prefixserve:num_preemptions_total", "prefixserve:num_requests_running", "prefixserve:num_requests_waiting",
    "ray_prefixserve_autoscaling_target_replicas", "ray_prefixserve_autoscaling_decisions_total",
    "prefixserve:spec_decode_num_accepted_tokens_total", "prefixserve:spec_decode_num_draft_tokens_total",
    "prefixserve:spec_decode_num_accepted_tokens_per_pos_total", "prefixserve:spec_decode_num_drafts_total",
}


def test_dashboard_plots_the_serving_and_autoscaling_metrics(chart):
    dashboard = json.loads(render(chart, values_of("values-gpu.yaml"))["ConfigMap"]["data"]["prefixserve.json"])
    panels = {panel["title"]: [target["expr"] for target in panel["targets"]] for panel in dashboard["panels"]}
    used = {name for exprs in panels.values() for expr in exprs
            for name in re.findall(r"(?:prefixserve:|ray_prefixserve_)[a-z_]+", expr)}
    assert used == DASHBOARD_METRICS
    per_replica = {title for title, exprs in panels.items() if any("by (replica" in e for e in exprs)}
    assert set(panels) - per_replica == {"Autoscaling decisions"}
