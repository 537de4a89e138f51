"""deploy/: the Kubernetes manifests parse, fit together, pass the Kubernetes schemas (offline), and
drive the real `precast serve`: the Deployment's args are accepted by the CLI, and its probe paths
answer 200 from the app those args build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
APP_LABEL = {"app.kubernetes.io/name": "precast-server"}


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"], f"{path.name}: a document without apiVersion/kind"
            key = (
                doc["kind"] if doc["kind"] == "Kustomization" else f"{doc['kind']}/{doc['metadata']['name']}"
            )
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


@pytest.fixture(scope="module")
def deployment(docs) -> dict:
    return docs["Deployment/precast-server"]


@pytest.fixture(scope="module")
def container(deployment) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_every_resource_is_in_the_kustomization(docs):
    listed = docs["Kustomization"]["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    kinds = {k.split("/")[0] for k in docs}
    want = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap", "Secret"}
    assert want <= kinds


def test_resources_pass_the_kubernetes_schemas(docs):
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    for key, doc in docs.items():
        if key != "Kustomization":
            kv.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_selectors_and_ports_line_up(docs, deployment, container):
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert (
        deployment["spec"]["selector"]["matchLabels"] == APP_LABEL and APP_LABEL.items() <= pod_labels.items()
    )
    assert docs["Service/precast-server"]["spec"]["selector"] == APP_LABEL
    assert docs["PodDisruptionBudget/precast-server"]["spec"]["selector"]["matchLabels"] == APP_LABEL
    target = docs["HorizontalPodAutoscaler/precast-server"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert ports["http"] == int(args[args.index("--port") + 1])
    assert docs["Service/precast-server"]["spec"]["ports"][0]["targetPort"] in ("http", ports["http"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in ("http", ports["http"]), probe
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    # The image listens where the manifests expect it.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"EXPOSE {ports['http']}" in dockerfile
    assert re.search(r'CMD \["serve", "/models/current", "--host", "0.0.0.0", "--port", "8000"\]', dockerfile)
    for src in re.findall(r"^COPY (?!--)(\S+)", dockerfile, flags=re.MULTILINE):
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which the repository lacks"


def test_admin_token_comes_from_the_secret(docs, container):
    from precast.runtime.server.config import ADMIN_TOKEN_ENV

    (env,) = [e for e in container["env"] if e["name"] == ADMIN_TOKEN_ENV]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["key"] in docs[f"Secret/{ref['name']}"]["stringData"]


def test_drain_fits_in_the_grace_period(docs, deployment):
    config = docs["ConfigMap/precast-server-config"]["data"]
    spec = deployment["spec"]["template"]["spec"]
    pre_stop = int(spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > float(config["PRECAST_DRAIN_TIMEOUT_S"]) + pre_stop


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_deployment_args_start_a_server_whose_probes_answer(docs, container, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from precast.cli.main import main
    from precast.compiler.driver import CompileOptions, compile_model
    from precast.runtime import server as server_pkg
    from precast.runtime.server import create_app
    from tests.helpers import save, tiny_mlp

    # The artifact volume: <mount>/current is a compiled artifact.
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "artifacts"]
    models = tmp_path / "models"
    compile_model(str(save(tiny_mlp(), tmp_path / "mlp.onnx")), models / "current", CompileOptions())
    env = dict(docs["ConfigMap/precast-server-config"]["data"])
    args = [
        a.replace(mount, str(models), 1) if a.startswith(mount) else a
        for a in _expand(container["args"], env)
    ]

    captured = []
    monkeypatch.setattr(server_pkg, "serve", captured.append)
    monkeypatch.setenv("PRECAST_ADMIN_TOKEN", "s3cret")  # what the Secret's env var gives the container
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code in (0, None)
    (config,) = captured
    assert config.host == "0.0.0.0" and config.port == 8000 and config.admin_token == "s3cret"
    assert config.artifact == models / "current" and config.threads == int(env["PRECAST_THREADS"])

    client = TestClient(create_app(config))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert client.get(path).status_code == 200, f"{probe} {path}"
    assert client.get("/metrics").status_code == 200
    # Hot reload needs the Secret's token once bound beyond loopback.
    assert client.post("/admin/reload").status_code == 401
    ok = client.post("/admin/reload", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["ok"]
