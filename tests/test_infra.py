"""infra/ is checked, not just shipped: every YAML parses and names entry points and configs that
exist (configs load and validate with the manifest's --set overrides; every flag it passes is one
the job accepts), Ray cluster configs pass Ray's own schema, KubeRay manifests validate against the
KubeRay CRDs' OpenAPI v3 schemas (vendored in infra/crds/, KubeRay v1.7.0) with unknown fields
rejected as `kubectl apply` rejects them, Kubernetes manifests have their required fields, models
and the Hugging Face token are mounted (HF_HOME on a volume, HF_TOKEN from a Secret) rather than
baked in, and every Dockerfile COPY/ADD source exists. The package installs like a library: no
exact torch pin in its dependencies, corner dependencies in extras, a console script per user job
whose --help works. Generic over the folder, so a new file there is checked too."""

import copy
import functools
import gzip
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
YAMLS = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))
DOCKERFILES = sorted(p for p in INFRA.rglob("*") if p.name == "Dockerfile" or p.name.endswith(".Dockerfile"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
"""Console script name -> "module:function", as pyproject.toml declares them."""
CRDS = {"RayJob": "ray.io_rayjobs.yaml.gz", "RayCluster": "ray.io_rayclusters.yaml.gz"}
"""KubeRay kind -> its vendored CRD file in infra/crds/."""


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
        if isinstance(command, list) and command and str(command[0]).split("/")[-1] in ("python", "python3", *SCRIPTS):
            yield as_module_argv([str(a) for a in command + list(node.get("args") or [])])
        for value in node.values():
            yield from exec_forms(value)
    elif isinstance(node, list):
        for value in node:
            yield from exec_forms(value)


def as_module_argv(argv: list[str]) -> list[str]:
    """A console script's argv (``bon-build --config X``) as the equivalent ``python -m jobs.X`` one."""
    name = argv[0].split("/")[-1]
    if name in SCRIPTS:
        return ["python", "-m", SCRIPTS[name].split(":")[0], *argv[1:]]
    return argv


def commands(documents) -> list[list[str]]:
    """Every `python -m ...` or console-script (`bon-build ...`) command line in the documents (shell
    strings and exec-form lists), as ``python -m MODULE`` argv lists with ``--flag=value`` split into
    ``--flag value``."""
    found = []
    scripts = "|".join(re.escape(s) for s in sorted(SCRIPTS, key=len, reverse=True))
    for text in (s for doc in documents for s in strings(doc)):
        for match in re.finditer(rf"(?:python3? -m |(?<![\w-])(?:{scripts})(?![\w-]))[^\n;&|]*", " ".join(text.split())):
            found.append(as_module_argv(shlex.split(match.group(0))))
    found += [argv for doc in documents for argv in exec_forms(doc) if "-m" in argv]
    return [[part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--") else [arg])]
            for argv in found]


@functools.cache
def job_help(module: str) -> str:
    """``python -m MODULE --help``, run from the repository root (as the image's WORKDIR)."""
    run = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"{module} --help: exit {run.returncode}: {run.stderr[-2000:]}"
    return run.stdout


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
            overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
            # validates every key, placement settings included, with the manifest's own overrides
            load_config(str(REPO / config), overrides)
        usage = job_help(module)
        for flag in (a for a in argv[argv.index("-m") + 2:] if a.startswith("--")):
            assert re.search(rf"{re.escape(flag)}(?![\w-])", usage), f"{path.name}: {module} has no flag {flag}"


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
    assert re.search(r"pip install[^\n]*\.\[vllm[],]", lines), f"{path.name}: does not install the [vllm] extra"
    extras = PYPROJECT["project"]["optional-dependencies"]
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


# --- KubeRay manifests against the KubeRay CRDs' OpenAPI v3 schemas ------------------------------


def strict(schema):
    """A CRD's structural schema as `kubectl apply` enforces it (strict field validation, the
    default since Kubernetes 1.27): an object with declared properties accepts no other field,
    except where the CRD says x-kubernetes-preserve-unknown-fields. jsonschema alone would let a
    typo'd key through, since the CRDs do not say additionalProperties: false."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_schema(kind: str) -> dict:
    """The ray.io/v1 openAPIV3Schema of a vendored KubeRay CRD, made strict."""
    with gzip.open(INFRA / "crds" / CRDS[kind], "rt") as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(version["schema"]["openAPIV3Schema"])


def kuberay_errors(doc: dict) -> list[str]:
    """Every schema violation of a KubeRay manifest (its kind's CRD; a RayJob's rayClusterSpec also
    against the RayCluster CRD's spec), as 'path: message' lines."""
    import jsonschema

    checks = [(crd_schema(doc["kind"]), doc)]
    if doc["kind"] == "RayJob" and "rayClusterSpec" in doc.get("spec", {}):
        checks.append((crd_schema("RayCluster")["properties"]["spec"], doc["spec"]["rayClusterSpec"]))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for schema, instance in checks
            for e in jsonschema.Draft7Validator(schema).iter_errors(instance)]


def kuberay_docs():
    return [(path, doc) for path in YAMLS for doc in yaml.safe_load_all(path.read_text())
            if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith("ray.io/")]


def test_every_kuberay_manifest_validates_against_its_crd():
    docs = kuberay_docs()
    assert any(doc["kind"] == "RayJob" for _, doc in docs)
    for path, doc in docs:
        assert doc["apiVersion"] == "ray.io/v1", f"{path.name}: {doc['apiVersion']} (the CRDs serve ray.io/v1)"
        assert doc["kind"] in CRDS, f"{path.name}: no vendored CRD for {doc['kind']} in infra/crds/"
        errors = kuberay_errors(doc)
        assert not errors, f"{path.name}: {doc['kind']} {doc['metadata']['name']}:\n" + "\n".join(errors[:10])


def rayjob() -> dict:
    (doc,) = [doc for _, doc in kuberay_docs() if doc["kind"] == "RayJob"]
    return copy.deepcopy(doc)


def _typo_under_spec(doc):
    doc["spec"]["shutdownAfterJobFinish"] = doc["spec"].pop("shutdownAfterJobFinishes")


def _typo_in_worker_group(doc):
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 8


def _typo_in_container(doc):
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["volumeMount"] = head.pop("volumeMounts")


def _replicas_as_string(doc):
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "8"


def _bad_quantity(doc):
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0][
        "resources"]["limits"]["memory"] = "64 gigabytes"


def _env_without_name(doc):
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"].append({"value": "1"})


def _no_containers(doc):
    del doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("mutate", [_typo_under_spec, _typo_in_worker_group, _typo_in_container, _replicas_as_string,
                                    _bad_quantity, _env_without_name, _no_containers],
                         ids=lambda f: f.__name__.strip("_"))
def test_the_crd_check_rejects_a_broken_rayjob(mutate):
    """The schema check can fail: a typo'd key (spec, worker group, pod template), a wrong type, a
    malformed resource quantity, a missing required field are each reported."""
    doc = rayjob()
    assert not kuberay_errors(doc)
    mutate(doc)
    assert kuberay_errors(doc), f"{mutate.__name__}: accepted"


# --- models and the Hugging Face token: mounted at run time, never baked in ----------------------


def dockerfile_env(path: Path) -> dict[str, str]:
    """The Dockerfile's ENV settings (``ENV K=V K2=V2`` and ``ENV K V`` forms)."""
    env = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        words = shlex.split(line.strip()) if line.strip().upper().startswith("ENV ") else []
        if len(words) == 3 and "=" not in words[1]:
            env[words[1]] = words[2]
        else:
            env.update(w.split("=", 1) for w in words[1:] if "=" in w)
    return env


def pod_templates(doc: dict) -> dict[str, dict]:
    """The pod templates of a manifest that run the pipeline: a KubeRay cluster's head and worker
    groups (not the job submitter, which only calls the Jobs API), a CronJob's or Job's pod."""
    if doc.get("kind") in ("RayJob", "RayCluster", "RayService"):
        return {role: t for role, t in ray_pod_templates(doc["spec"]).items() if role != "submitter"}
    if doc.get("kind") == "CronJob":
        return {"pod": doc["spec"]["jobTemplate"]["spec"]["template"]}
    if doc.get("kind") == "Job":
        return {"pod": doc["spec"]["template"]}
    return {}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_models_and_token_are_mounted_not_baked(path):
    """Every pipeline container takes HF_TOKEN from a Kubernetes Secret (env valueFrom secretKeyRef,
    never a literal) and has HF_HOME, the image's, on a persistent volume (a PVC or a hostPath), so
    hub models download once per cluster and gated ones can be read. The image's HF_HOME is the
    manifests'. Before: no manifest set either, yet configs/cluster_gpu.yaml names gated models."""
    (dockerfile,) = DOCKERFILES
    image_home = dockerfile_env(dockerfile).get("HF_HOME")
    assert image_home, "infra/Dockerfile: no ENV HF_HOME (the mount point of the model cache)"
    pods = 0
    for doc in (d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)):
        for role, template in pod_templates(doc).items():
            pods += 1
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            for container in template["spec"]["containers"]:
                where = f"{path.name}: {role} {container['name']}"
                env = {e["name"]: e for e in container.get("env", [])}
                assert "value" not in env.get("HF_TOKEN", {}), f"{where}: HF_TOKEN written into the manifest"
                assert env.get("HF_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {}).get("name"), \
                    f"{where}: HF_TOKEN does not come from a Secret"
                home = env.get("HF_HOME", {}).get("value", image_home)
                assert home == image_home, f"{where}: HF_HOME {home} is not the image's {image_home}"
                mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == home]
                assert mounts, f"{where}: nothing mounted at HF_HOME {home}"
                volume = volumes.get(mounts[0]["name"], {})
                assert "persistentVolumeClaim" in volume or "hostPath" in volume, \
                    f"{where}: HF_HOME is on {volume or 'no volume'}, not a PVC or hostPath"
    if path.name in ("rayjob.yaml", "expert_iteration_cronjob.yaml"):
        assert pods, f"{path.name}: no pod template found"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_as_non_root_with_no_secret_and_matches_check_install(path):
    """Non-root (the ray base image's user), no token in ENV or ARG, and the Python and extras that
    `make check-install` resolves are the image's."""
    text = path.read_text().replace("\\\n", " ")
    instructions = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    users = [i.split()[1] for i in instructions if i.split()[0].upper() == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{path.name}: the image's last USER is {users or 'unset'}"
    for i in instructions:
        if i.split()[0].upper() in ("ENV", "ARG"):
            assert not re.search(r"TOKEN|SECRET|PASSWORD|AWS_", i, re.I), f"{path.name}: a secret baked in: {i}"
    base = next(i for i in instructions if i.split()[0].upper() == "FROM").split()[1]
    makefile = (REPO / "Makefile").read_text()
    py = re.search(r"-py(\d)(\d+)", base)
    assert py, f"{path.name}: FROM {base} names no Python"
    assert re.search(rf"^IMAGE_PYTHON := {py.group(1)}\.{py.group(2)}$", makefile, re.M), \
        f"Makefile: IMAGE_PYTHON is not the image's Python {py.group(1)}.{py.group(2)}"
    (extras,) = re.findall(r'pip install[^\n]*\.\[([\w,]+)\]', "\n".join(instructions))
    assert re.search(rf"^IMAGE_EXTRAS := {re.escape(extras)}$", makefile, re.M), \
        f"Makefile: IMAGE_EXTRAS is not the image's [{extras}]"
    assert "-c " not in text.split("pip install", 1)[1].split("\n", 1)[0], \
        f"{path.name}: the CPU constraints file would fight vLLM's own torch pin"
    (workdir,) = [i.split()[1] for i in instructions if i.split()[0].upper() == "WORKDIR"]
    for manifest in YAMLS:
        for doc in (d for d in yaml.safe_load_all(manifest.read_text()) if isinstance(d, dict)):
            for role, template in pod_templates(doc).items():
                for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                    assert container.get("workingDir", workdir) == workdir, \
                        f"{manifest.name}: {role} {container['name']}: workingDir is not the image's {workdir}"


# --- the CronJob (batch/v1: no CRD, so its required fields and paths are checked here) ------------


def cronjobs():
    return [(path, doc) for path in YAMLS for doc in yaml.safe_load_all(path.read_text())
            if isinstance(doc, dict) and doc.get("kind") == "CronJob"]


def test_cronjob_has_required_fields_and_real_paths():
    """batch/v1 CronJob: a five-field schedule, a job template whose pod has named containers with
    an image and restartPolicy OnFailure or Never. Every absolute path a container passes lies on one
    of its volumes, every PVC it mounts is defined beside it, and relative paths (--config) are in
    the image, under its WORKDIR (the repository's configs/, which the Dockerfile copies)."""
    jobs = cronjobs()
    assert jobs
    for path, doc in jobs:
        assert doc["apiVersion"] == "batch/v1"
        spec = doc["spec"]
        assert len(spec["schedule"].split()) == 5, f"{path.name}: schedule {spec['schedule']!r}"
        assert spec.get("concurrencyPolicy", "Allow") in ("Allow", "Forbid", "Replace")
        pod = spec["jobTemplate"]["spec"]["template"]["spec"]
        assert pod.get("restartPolicy") in ("OnFailure", "Never"), f"{path.name}: restartPolicy"
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {d["metadata"]["name"] for d in yaml.safe_load_all(path.read_text())
                  if isinstance(d, dict) and d.get("kind") == "PersistentVolumeClaim"}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, \
                    f"{path.name}: PVC {volume['persistentVolumeClaim']['claimName']} is defined nowhere in the file"
        containers = pod["containers"] + pod.get("initContainers", [])
        for container in containers:
            assert container.get("name") and container.get("image"), f"{path.name}: a container without name/image"
            mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
            assert all(m["name"] in volumes for m in container.get("volumeMounts", [])), f"{path.name}: unknown volume"
            for arg in (str(a) for a in container.get("command", []) + container.get("args", [])):
                value = arg.split("=")[-1]
                if value.startswith("/"):
                    assert any((value.rstrip("/") + "/").startswith(m) for m in mounts), \
                        f"{path.name}: {container['name']}: {value} is on no volume of the pod (not in the image)"
                elif value.startswith(("configs/", "benchmarks/")):
                    assert (REPO / value).exists(), f"{path.name}: {value} does not exist"
        # The models the schedule starts from are written by a step of the pod itself (an init
        # container) or must be put on the volume by hand: the first is checked when present.
        producers = " ".join(" ".join(map(str, c.get("command", []) + c.get("args", [])))
                             for c in pod.get("initContainers", []))
        main_args = " ".join(map(str, pod["containers"][0].get("args", [])))
        for model in re.findall(r"models\.(?:generator|reward)=(/\S+)", main_args):
            out = re.search(r"--output[= ](/\S+)", producers)
            assert out is None or model.startswith(out.group(1).rstrip("/") + "/"), \
                f"{path.name}: {model} is not written by the init container ({out.group(1)})"


# --- installs like a library ----------------------------------------------------------------------


def test_package_pins_no_torch_and_keeps_corner_dependencies_in_extras():
    """The exact torch pin (the local CPU wheel) lives only in infra/constraints.txt; the package asks
    for a floor, so a GPU image keeps vLLM's CUDA torch. matplotlib (plots) and gguf (GGUF loading)
    are extras, and `make install` installs them with the test extras."""
    deps = PYPROJECT["project"]["dependencies"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower(): d for d in deps}
    assert re.fullmatch(r"torch>=[\d.]+", names["torch"]), f"pyproject: torch is {names['torch']!r}"
    assert "matplotlib" not in names and "gguf" not in names
    assert any(r.startswith("matplotlib") for r in extras["plots"]) and any(r.startswith("gguf") for r in extras["gguf"])
    assert any(r.startswith("jsonschema") for r in extras["test"])
    assert re.search(r"^torch==\S+$", (INFRA / "constraints.txt").read_text(), re.M)
    install = (REPO / "Makefile").read_text().split("$(STAMP): ", 1)[1].split("\n\n", 1)[0]
    assert re.search(r'-e "\.\[[^]]*plots[^]]*\]"', install) and "gguf" in install and "-c $(CONSTRAINTS)" in install


def test_every_user_job_has_a_console_script():
    """bon-* for every user job, each pointing at an existing jobs module's main()."""
    assert {"bon-build", "bon-expert-iteration", "bon-evaluate", "bon-counterfactual", "bon-train-reward-transformer",
            "bon-fetch-models", "bon-make-tiny-models", "bon-build-trigram", "bon-gguf-convert"} <= set(SCRIPTS)
    for name, target in SCRIPTS.items():
        module, function = target.split(":")
        source = (REPO / (module.replace(".", "/") + ".py")).read_text()
        assert re.search(rf"^def {function}\(argv: list\[str\] \| None = None\) -> int:", source, re.M), \
            f"{name}: {target} has no main(argv=None) -> int"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_is_installed_and_its_help_exits_0(name):
    """After `make install` each script is in the venv's bin/ and `--help` exits 0 with a usage line."""
    script = Path(sys.executable).parent / name
    assert script.exists(), f"{script}: not installed (make install)"
    run = subprocess.run([str(script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{name} --help: exit {run.returncode}: {run.stderr[-2000:]}"
    assert run.stdout.lstrip().lower().startswith("usage:"), f"{name} --help: {run.stdout[:200]!r}"
