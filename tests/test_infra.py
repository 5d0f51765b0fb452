"""infra/ is checked, not just shipped: every YAML parses and names entry points and configs that
exist (configs load and validate), Ray cluster configs pass Ray's own schema, Kubernetes manifests
have their required fields, and every Dockerfile COPY/ADD source exists. Generic over the folder,
so a new file there is checked too."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
YAMLS = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))
DOCKERFILES = sorted(p for p in INFRA.rglob("*") if p.name == "Dockerfile" or p.name.endswith(".Dockerfile"))


def strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def exec_forms(node):
    """Kubernetes exec-form commands: a container's ``command`` list followed by its ``args``."""
    if isinstance(node, dict):
        command = node.get("command")
        if isinstance(command, list) and command and str(command[0]).split("/")[-1] in ("python", "python3"):
            yield [str(a) for a in command + list(node.get("args") or [])]
        for value in node.values():
            yield from exec_forms(value)
    elif isinstance(node, list):
        for value in node:
            yield from exec_forms(value)


def commands(documents) -> list[list[str]]:
    """Every `python -m ...` command line in the documents (shell strings and exec-form lists), as
    argv lists with ``--flag=value`` split into ``--flag value``."""
    found = []
    for text in (s for doc in documents for s in strings(doc)):
        for match in re.finditer(r"python3? -m [^\n;&|]+", " ".join(text.split())):
            found.append(shlex.split(match.group(0)))
    found += [argv for doc in documents for argv in exec_forms(doc) if "-m" in argv]
    return [[part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--") else [arg])]
            for argv in found]


def test_infra_holds_what_the_cluster_needs():
    assert YAMLS and DOCKERFILES
    kinds = set()
    for path in YAMLS:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict):
                kinds.add(doc.get("kind") or ("ray up" if "available_node_types" in doc else None))
    assert {"ray up", "RayJob"} <= kinds


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_parses_and_names_our_entry_points(path):
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert documents, f"{path.name}: empty"
    argvs = commands(documents)
    assert argvs, f"{path.name}: names no `python -m` entry point"
    for argv in argvs:
        module = argv[argv.index("-m") + 1]
        assert module.split(".")[0] in ("jobs", "benchmarks"), f"{path.name}: {module} is not one of ours"
        file = REPO / (module.replace(".", "/") + ".py")
        assert file.exists(), f"{path.name}: entry point {module} has no {file.relative_to(REPO)}"
        if "--config" in argv:
            config = argv[argv.index("--config") + 1]
            assert (REPO / config).exists(), f"{path.name}: config {config} does not exist"
            load_config(str(REPO / config))  # validates every key, placement settings included


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_cluster_configs_pass_ray_schema_and_manifests_have_required_fields(path):
    import jsonschema
    import ray.autoscaler

    for doc in yaml.safe_load_all(path.read_text()):
        if not isinstance(doc, dict):
            continue
        if "available_node_types" in doc:  # a `ray up` cluster config
            schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
            jsonschema.validate(doc, schema)
            assert doc["head_node_type"] in doc["available_node_types"]
            gpus = [t["resources"].get("GPU", 0) for t in doc["available_node_types"].values()]
            assert max(gpus) >= 1, f"{path.name}: no GPU node type"
        elif "apiVersion" in doc:  # a Kubernetes manifest
            assert doc.get("kind") and doc.get("metadata", {}).get("name"), f"{path.name}: kind and metadata.name"
            if doc["kind"] == "RayJob":
                spec = doc["spec"]
                assert doc["apiVersion"] == "ray.io/v1" and spec["entrypoint"]
                head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
                workers = spec["rayClusterSpec"]["workerGroupSpecs"]
                assert head[0]["image"] and workers
                limits = [c["resources"]["limits"] for w in workers for c in w["template"]["spec"]["containers"]]
                assert any("nvidia.com/gpu" in lim for lim in limits), f"{path.name}: no GPU worker group"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_sources_exist_and_it_installs_the_vllm_extra(path):
    # One instruction per line once continuations are joined; comments dropped.
    instructions = [line.strip() for line in path.read_text().replace("\\\n", " ").splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    lines = "\n".join(instructions)
    copies = [shlex.split(i)[1:] for i in instructions if i.split()[0].upper() in ("COPY", "ADD")]
    assert copies
    for args in copies:
        if any(a.startswith("--from") for a in args):
            continue  # from another build stage
        for source in [a for a in args if not a.startswith("--")][:-1]:
            assert (REPO / source).exists(), f"{path.name}: COPY source {source} does not exist"
    assert re.search(r"pip install[^\n]*\.\[vllm\]", lines), f"{path.name}: does not install the [vllm] extra"
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.split("[")[0].split("=")[0].split(">")[0].strip().startswith("vllm") for req in extras["vllm"])
    assert any(i.split()[0].upper() == "FROM" for i in instructions)


def test_gpu_config_places_actors_with_a_placement_group():
    config = load_config(str(REPO / "configs" / "cluster_gpu.yaml"))
    rt = config.runtime
    assert rt.placement_strategy in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
    assert rt.generator.num_gpus >= 1 and rt.reward.num_gpus >= 1 and config.models.device == "cuda"


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def ray_pod_templates(spec: dict) -> dict[str, dict]:
    """A KubeRay spec's pod templates by role: the head, each worker group and (RayJob) the job
    submitter, which calls the Jobs API too. A RayJob's cluster is its rayClusterSpec."""
    cluster = spec.get("rayClusterSpec", spec)
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({f"worker group {g['groupName']}": g["template"] for g in cluster.get("workerGroupSpecs", [])})
    if "submitterPodTemplate" in spec:
        templates["submitter"] = spec["submitterPodTemplate"]
    return templates


def token_secret(container: dict, pod: dict) -> str | None:
    """The Secret the container's Ray takes its token from: RAY_AUTH_TOKEN from a secretKeyRef, or
    RAY_AUTH_TOKEN_PATH inside a mounted secret volume; None when the token comes from anywhere else."""
    env = {e["name"]: e for e in container.get("env", [])}
    ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
    if ref:
        return ref["name"]
    path = env.get("RAY_AUTH_TOKEN_PATH", {}).get("value", "")
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in secrets and path.startswith(mount["mountPath"].rstrip("/") + "/"):
            return secrets[mount["name"]]
    return None


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_the_jobs_api_is_never_open_without_a_token(path):
    """Ray's dashboard is the Jobs API: whoever reaches it runs code on the cluster. Every Ray node a
    manifest starts runs with RAY_AUTH_MODE=token and a token that lives outside the repository (a
    Kubernetes Secret, referenced by every Ray container: head, workers, job submitter; for `ray up`,
    the token file copied to every node), and a dashboard on a non-loopback address is allowed only
    with that. Before: rayjob.yaml and ray-cluster.yaml bound it to 0.0.0.0 with no token."""
    for doc in yaml.safe_load_all(path.read_text()):
        if not isinstance(doc, dict):
            continue
        if "available_node_types" in doc:  # `ray up`
            starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
                      for c in doc.get(key, []) if "ray start" in c]
            assert starts, f"{path.name}: no `ray start`"
            for command in starts:
                assert re.search(r"\bRAY_AUTH_MODE=token\b", command), f"{path.name}: `{command}` without token auth"
                host = re.search(r"--dashboard-host[= ](\S+)", command)
                assert host is None or host.group(1) in LOOPBACK, f"{path.name}: dashboard on {host.group(1)}"
            mounts = doc.get("file_mounts") or {}
            assert any(remote.endswith(".ray/auth_token") for remote in mounts), \
                f"{path.name}: the token file does not reach the nodes (file_mounts)"
        elif doc.get("kind") in ("RayJob", "RayCluster", "RayService"):
            spec = doc["spec"]
            secrets = set()
            for role, template in ray_pod_templates(spec).items():
                for container in template["spec"]["containers"]:
                    env = {e["name"]: e.get("value") for e in container.get("env", [])}
                    assert env.get("RAY_AUTH_MODE") == "token", f"{path.name}: {role} {container['name']}: no token auth"
                    assert "RAY_AUTH_TOKEN" not in env or env["RAY_AUTH_TOKEN"] is None, \
                        f"{path.name}: {role}: a token written into the manifest"
                    secret = token_secret(container, template["spec"])
                    assert secret, f"{path.name}: {role} {container['name']}: the token comes from no Secret"
                    secrets.add(secret)
            assert len(secrets) == 1, f"{path.name}: Ray containers take their token from different Secrets {secrets}"
        elif doc.get("kind") == "Secret":
            assert not doc.get("data") and not any(doc.get("stringData", {}).values()), \
                f"{path.name}: a Secret with its value in the repository"
