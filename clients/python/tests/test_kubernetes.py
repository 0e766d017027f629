"""The Kubernetes packaging (deploy/k8s), checked offline: every manifest against the
Kubernetes API's own schemas (kubernetes-validate, strict: an unknown or misplaced field
fails), the kustomization against the files it names, and the rules the deployment promises
(docs/operations.md, "On Kubernetes"): non-root and unprivileged pods that pass Pod Security's
"restricted" level, resources and probes on every container, secrets as read-only files of the
pod's own group, budgets and Services that select their pods, and settings the binaries know."""

import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import ROOT, binary, built

K8S = ROOT / "deploy" / "k8s"
#: The Kubernetes versions the manifests are checked against: the oldest meant for (its
#: `unhealthyPodEvictionPolicy` is GA in 1.31) and the newest the validator knows.
VERSIONS = ("1.31", "1.37")


def documents():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        found.extend(doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc)
    return kustomization, found


def pods(found):
    """(workload, its pod spec) of every workload."""
    return [
        (doc, doc["spec"]["template"]["spec"])
        for doc in found
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_for_the_kubernetes_api(version):
    _, found = documents()
    kinds = sorted(doc["kind"] for doc in found)
    assert kinds == [
        "Deployment",
        "Namespace",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    for doc in found:
        kubernetes_validate.validate(doc, version, strict=True)
    # The validator does fail: a field the API does not know.
    broken = dict(found[1], spec={**found[1]["spec"], "replica": 2})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_kustomization_names_files_that_exist_and_the_one_image():
    kustomization, found = documents()
    for name in kustomization["resources"]:
        assert (K8S / name).is_file(), name
    for generator in kustomization["configMapGenerator"]:
        for name in generator["files"]:
            assert (K8S / name).is_file(), name
    images = {container["image"] for _, spec in pods(found) for container in spec["containers"]}
    assert images == {kustomization["images"][0]["name"]}
    assert {doc["metadata"].get("namespace") for doc in found} == {None}, (
        "the kustomization sets the namespace"
    )


def test_pods_run_unprivileged_as_the_images_user_with_resources_and_probes():
    _, found = documents()
    for workload, spec in pods(found):
        name = workload["metadata"]["name"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] and pod["runAsUser"] == 10001, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)
            assert "readinessProbe" in container and "livenessProbe" in container, name
            ports = {port["name"] for port in container.get("ports", [])}
            for probe in (container["readinessProbe"], container["livenessProbe"]):
                for action in ("httpGet", "tcpSocket"):
                    if action in probe:
                        assert probe[action]["port"] in ports, (name, probe)


def test_secrets_are_read_only_files_of_the_pods_own_group_never_environment_values():
    _, found = documents()
    for workload, spec in pods(found):
        name = workload["metadata"]["name"]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        for container in spec["containers"]:
            for variable in container.get("env", []):
                assert "valueFrom" not in variable, (name, variable)
                assert not re.search("TOKEN$|PASSWORD|SECRET|KEY$", variable["name"]), (
                    name,
                    variable,
                )
            for mount in container["volumeMounts"]:
                volume = volumes[mount["name"]]
                secret = "secret" in volume or any(
                    "secret" in source for source in volume.get("projected", {}).get("sources", [])
                )
                if secret:
                    assert mount["readOnly"] and mount["mountPath"] == "/run/secrets", name
                    mode = volume.get("projected", volume.get("secret", {}))["defaultMode"]
                    assert mode == 0o440, (name, oct(mode))
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]


def test_services_and_budgets_select_their_pods():
    _, found = documents()
    labels = {
        workload["metadata"]["name"]: workload["spec"]["template"]["metadata"]["labels"]
        for workload, _ in pods(found)
    }
    for workload, _ in pods(found):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels[workload["metadata"]["name"]].items()
    for doc in found:
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
        elif doc["kind"] == "PodDisruptionBudget":
            selector = doc["spec"]["selector"]["matchLabels"]
        else:
            continue
        matched = [name for name, pod in labels.items() if selector.items() <= pod.items()]
        assert matched == [doc["metadata"]["name"]], (doc["kind"], doc["metadata"]["name"])
    server = next(doc for doc in found if doc["kind"] == "Deployment")
    assert server["spec"]["replicas"] >= 2, "any replica serves any ticket: more than one"
    writer = next(doc for doc in found if doc["kind"] == "StatefulSet")
    # A rollout replaces a writer that is not ready (a failing table, a long snapshot).
    assert writer["spec"]["podManagementPolicy"] == "Parallel"
    # Writers beyond one share the tables by lease; without [fleet] the second is fenced idle.
    if writer["spec"]["replicas"] > 1:
        assert "\n[fleet]\n" in (K8S / "sidecar.toml").read_text()
    accounts = {doc["metadata"]["name"] for doc in found if doc["kind"] == "ServiceAccount"}
    assert writer["spec"]["template"]["spec"]["serviceAccountName"] in accounts


def test_the_settings_the_manifests_give_are_known_to_the_binaries():
    """Every environment variable a manifest sets is one its own binary reads (clap's help
    names the server's and the writer's; the Flight client's are in its source), the
    server's args are a command it has, and the sidecar file's server is the Service the
    manifests define, over TLS."""
    _, found = documents()

    def help_of(program, *commands):
        return "".join(
            subprocess.run(
                [program, *command.split(), "--help"], capture_output=True, text=True, check=True
            ).stdout
            for command in commands
        )

    writer_binary = built("mssql-cdc-writer", "MSSQL_CDC_WRITER_BIN")
    helps = {
        "Deployment": help_of(binary(), "serve"),
        "StatefulSet": help_of(writer_binary, "run", "backfill"),
    }
    client_source = (ROOT / "proto" / "src" / "client.rs").read_text()
    for workload, spec in pods(found):
        for container in spec["containers"]:
            for variable in container.get("env", []):
                name = variable["name"]
                if name == "RUST_LOG":
                    continue
                known = f"[env: {name}=" in helps[workload["kind"]] or f'"{name}"' in client_source
                assert known, (workload["metadata"]["name"], name)
        if workload["kind"] == "Deployment":
            assert spec["containers"][0]["args"] == ["serve"]
        else:
            command = spec["containers"][0]["command"] + spec["containers"][0]["args"]
            assert command[:2] == ["mssql-cdc-writer", "run"]
            config_path = Path(command[command.index("--config") + 1])
            assert config_path.name == "sidecar.toml"
    sidecar = (K8S / "sidecar.toml").read_text()
    service = next(doc for doc in found if doc["kind"] == "Service")
    port = service["spec"]["ports"][0]["port"]
    assert f'server = "https://{service["metadata"]["name"]}:{port}"' in sidecar
    assert 'status_listen = "0.0.0.0:8088"' in sidecar and "status_token_file" in sidecar
