"""Every Kubernetes manifest and Serve config the project ships (deploy/k8s/*.yaml, the YAML blocks of
docs/autoscaling.md and docs/scale-out.md) validated without a cluster: core kinds against Kubernetes' own
schemas (kubernetes-validate, pinned), KEDA's ScaledObject against its models (cloudcoil.models.keda, pinned),
a RayService against its KubeRay v1 structure, its pod templates as core PodTemplates, its serveConfigV2
against Ray Serve's own schema and its application arguments against `ScaleOutOptions`. Unknown fields fail:
the model libraries would drop them silently, so what they keep is compared with what was written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"
MANIFESTS = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
DOCS = [ROOT / "docs" / "autoscaling.md", ROOT / "docs" / "scale-out.md"]

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"metadata": {"type": "object"},
                                                                     "spec": {"type": "object"}}}
# The ray.io/v1 RayService fields this project writes (KubeRay's CRD, api/ray/v1); anything else is a typo here.
RAYSERVICE_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["serveConfigV2", "rayClusterConfig"], "additionalProperties": False,
                 "properties": {
                     "serveConfigV2": {"type": "string"},
                     "upgradeStrategy": {"type": "object"},
                     "rayClusterConfig": {
                         "type": "object", "required": ["headGroupSpec"], "additionalProperties": False,
                         "properties": {
                             "rayVersion": {"type": "string"}, "enableInTreeAutoscaling": {"type": "boolean"},
                             "autoscalerOptions": {"type": "object"},
                             "headGroupSpec": {"type": "object", "required": ["template"], "additionalProperties": False,
                                               "properties": {"rayStartParams": _STR_MAP, "template": _TEMPLATE,
                                                              "serviceType": {"type": "string"}}},
                             "workerGroupSpecs": {"type": "array", "items": {
                                 "type": "object", "required": ["groupName", "template"], "additionalProperties": False,
                                 "properties": {"groupName": {"type": "string"},
                                                "replicas": {"type": "integer", "minimum": 0},
                                                "minReplicas": {"type": "integer", "minimum": 0},
                                                "maxReplicas": {"type": "integer", "minimum": 0},
                                                "rayStartParams": _STR_MAP, "template": _TEMPLATE}}}}}}},
    },
}


def dropped(written: Any, kept: Any, path: str = "") -> list[str]:
    """Paths in `written` that a model's dump `kept` lacks (fields it did not know)."""
    if isinstance(written, dict) and isinstance(kept, dict):
        out = []
        for key, value in written.items():
            if key not in kept:
                out.append(f"{path}.{key}")
            else:
                out += dropped(value, kept[key], f"{path}.{key}")
        return out
    if isinstance(written, list) and isinstance(kept, list):
        return [p for i, (a, b) in enumerate(zip(written, kept)) for p in dropped(a, b, f"{path}[{i}]")]
    return []


def validate_serve_config(config: dict[str, Any]) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")
    from ray.serve.schema import ServeDeploySchema

    from deploy.ray_serve import _coerce

    model = ServeDeploySchema.model_validate(config)
    assert dropped(config, model.model_dump(exclude_unset=True)) == []
    for app in config["applications"]:
        if app["import_path"].startswith("deploy.ray_serve:"):
            _coerce(app.get("args") or {})  # every argument is a ScaleOutOptions field of the right type


def validate_manifest(doc: dict[str, Any]) -> str:
    kind = doc.get("kind")
    if kind == "ScaledObject":
        from cloudcoil.models.keda.v1alpha1 import ScaledObject

        model = ScaledObject.model_validate(doc)
        assert dropped(doc, model.model_dump(by_alias=True, exclude_unset=True, mode="json")) == []
    elif kind == "RayService":
        jsonschema.validate(doc, RAYSERVICE_SCHEMA)
        cluster = doc["spec"]["rayClusterConfig"]
        for group in [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": group["template"]}, K8S_VERSION, strict=True)
        validate_serve_config(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return kind


def doc_blocks(path: Path) -> list[dict[str, Any]]:
    """The YAML code blocks of a markdown page that are whole documents (fragments are left out)."""
    out = []
    for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S):
        data = yaml.safe_load(block)
        if isinstance(data, dict) and ("kind" in data or "applications" in data):
            out.append(data)
    return out


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_shipped_manifest_validates(path):
    kinds = [validate_manifest(doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert kinds


def test_shipped_manifests_cover_kuberay_and_keda():
    kinds = {doc["kind"] for p in MANIFESTS for doc in yaml.safe_load_all(p.read_text()) if doc}
    assert {"RayService", "ScaledObject", "Deployment", "Service", "ConfigMap"} <= kinds


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_the_docs_yaml_validates(path):
    blocks = doc_blocks(path)
    assert blocks, f"{path.name} has no whole manifest or Serve config"
    for data in blocks:
        if "applications" in data:
            validate_serve_config(data)
        else:
            validate_manifest(data)


def test_the_validators_reject_what_they_should():
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
                                      "spec": {"portz": []}}, K8S_VERSION, strict=True)
    scaled = next(d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "ScaledObject")
    with pytest.raises(AssertionError):
        validate_manifest({**scaled, "spec": {**scaled["spec"], "minReplicaCnt": 1}})
    ray_service = next(d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "RayService")
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest({**ray_service, "spec": {**ray_service["spec"], "serveConfig": "x"}})
    bad_args = ray_service["spec"]["serveConfigV2"].replace("num_gpus: 1", "num_gpu: 1")
    with pytest.raises(Exception, match="num_gpu"):
        validate_manifest({**ray_service, "spec": {**ray_service["spec"], "serveConfigV2": bad_args}})
