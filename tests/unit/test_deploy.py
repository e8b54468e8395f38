"""deploy/: the KubeRay RayJob, its volume and the image agree with each other and with the
package (recipes, config schema, extras, the Ray pin).

These check structure only; nothing here talks to Kubernetes or builds the image.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from rltune.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


# ---------------------------------------------------------------------------- loading


def _docs(name: str) -> list[dict]:
    with open(DEPLOY / name, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _one(name: str, kind: str) -> dict:
    found = [d for d in _docs(name) if d.get("kind") == kind]
    assert len(found) == 1, f"deploy/{name}: expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return _one("rayjob.yaml", "RayJob")


@pytest.fixture(scope="module")
def pvc() -> dict:
    return _one("pvc.yaml", "PersistentVolumeClaim")


@pytest.fixture(scope="module")
def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _ray_pin(pyproject: dict) -> str:
    pins = [r for r in pyproject["project"]["optional-dependencies"]["dev"] if re.match(r"ray\s*==", r)]
    assert len(pins) == 1, "pyproject.toml: the dev extra should pin ray exactly once (ray==X.Y.Z)"
    return pins[0].split("==", 1)[1].strip()


def _dockerfile() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of deploy/Dockerfile, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    out = []
    for line in logical:
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _base_image() -> str:
    """The FROM image with the ARG defaults declared before it substituted."""
    args: dict[str, str] = {}
    for word, rest in _dockerfile():
        if word == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key.strip()] = value.strip().strip("\"'")
        if word == "FROM":
            image = rest.split()[0]
            return re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image)
    raise AssertionError("deploy/Dockerfile has no FROM")


def _workdir() -> str:
    dirs = [rest for word, rest in _dockerfile() if word == "WORKDIR"]
    assert dirs, "deploy/Dockerfile sets no WORKDIR"
    return dirs[-1]


# ------------------------------------------------------------------ the entrypoint


def _script(rayjob: dict) -> str:
    words = shlex.split(rayjob["spec"]["entrypoint"])
    assert words[:2] == ["bash", "-c"] and len(words) == 3, (
        "the entrypoint should be one `bash -c '...'`: KubeRay pastes it into the submitter's "
        "shell line, where a bare `;` or `||` would run in the submitter"
    )
    return words[2]


def _commands(rayjob: dict) -> list[list[str]]:
    """The simple commands of the entrypoint's script, split at ; && || and newlines."""
    return [shlex.split(part) for part in re.split(r";|&&|\|\||\n", _script(rayjob)) if part.strip()]


def _trains(rayjob: dict) -> list[tuple[str, list[str]]]:
    """``(recipe, overrides)`` of every ``rltune train`` in the entrypoint, in order."""
    trains = [(c[2], c[3:]) for c in _commands(rayjob) if c[:2] == ["rltune", "train"]]
    assert trains, "the entrypoint runs no `rltune train`"
    return trains


def _configs(rayjob: dict) -> list[Config]:
    return [load_config(ROOT / recipe, overrides) for recipe, overrides in _trains(rayjob)]


def _main(rayjob: dict) -> Config:
    """The run the job is for: the last ``rltune train`` of the entrypoint."""
    return _configs(rayjob)[-1]


# ------------------------------------------------------------------- the Ray cluster


def _cluster(rayjob: dict) -> dict:
    return rayjob["spec"]["rayClusterSpec"]


def _head_pod(rayjob: dict) -> dict:
    return _cluster(rayjob)["headGroupSpec"]["template"]["spec"]


def _worker_groups(rayjob: dict) -> list[dict]:
    groups = _cluster(rayjob).get("workerGroupSpecs") or []
    assert groups, "the RayJob has no worker group"
    return groups


def _pods(rayjob: dict) -> list[dict]:
    return [_head_pod(rayjob)] + [g["template"]["spec"] for g in _worker_groups(rayjob)]


def _containers(rayjob: dict) -> list[dict]:
    return [c for pod in _pods(rayjob) for c in pod["containers"]]


def _quantity(value: Any) -> float:
    """A Kubernetes CPU or GPU quantity: ``4``, ``"4"``, ``"500m"``."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _pod_capacity(group: dict) -> dict[str, float]:
    """What one worker pod of ``group`` offers Ray: ``ray start``'s num-cpus / num-gpus when
    given, else (as KubeRay does) the container's limits."""
    params = group.get("rayStartParams") or {}
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return {
        "CPU": _quantity(params.get("num-cpus", limits.get("cpu", 0))),
        "GPU": _quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
    }


# ============================================================================ tests


def test_rayjob_kind_and_api(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1"
    assert rayjob["kind"] == "RayJob"
    assert rayjob["metadata"]["name"]


def test_entrypoint_trains_recipes_that_exist(rayjob):
    for recipe, _ in _trains(rayjob):
        path = Path(recipe)
        assert not path.is_absolute() and path.parts[0] == "recipes", recipe
        assert (ROOT / path).is_file(), f"the entrypoint trains {recipe}, which is not in recipes/"
    assert _trains(rayjob)[-1][0] == "recipes/arith-grpo.yaml"


def test_entrypoint_runs_where_the_image_put_the_recipes(rayjob):
    """Recipe paths are relative: the script must first cd to the image's copy of the repo."""
    first = _commands(rayjob)
    cds = [c for c in first if c[0] == "cd"]
    assert cds and first.index(cds[0]) < min(first.index(c) for c in first if c[:2] == ["rltune", "train"])
    assert cds[0][1] == _workdir()
    copies = [rest.split()[-2:] for word, rest in _dockerfile() if word == "COPY"]
    assert ["recipes", "./recipes"] in copies or ["recipes", f"{_workdir()}/recipes"] in copies


def test_entrypoint_script_survives_the_submitter_shell(rayjob):
    """``ray job submit`` re-quotes the arguments with double quotes, and the job runs them
    through /bin/sh again: quotes, ``$``, backquotes or backslashes would be mangled."""
    assert not set(_script(rayjob)) & set("'\"$`\\")


def test_overrides_validate_as_ray_run(rayjob):
    cfg = _main(rayjob)  # load_config raises ConfigError on any bad key or value
    assert cfg.runtime.mode == "ray"
    assert cfg.runtime.ray_address == "auto"
    assert cfg.checkpoint.every > 0, "resuming after a failure needs periodic checkpoints"


def test_every_run_resumes_and_writes_to_the_volume(rayjob):
    for cfg in _configs(rayjob):
        assert cfg.checkpoint.resume == "auto", (
            f"{cfg.name}: pass checkpoint.resume=auto (the default is never)"
        )
        assert cfg.log.dir == _main(rayjob).log.dir


def test_grpo_starts_from_the_sft_export_on_the_volume(rayjob):
    """The recipe's model.path is the SFT warm-up's export under its own log.dir; on the
    cluster both live on the volume, and the warm-up is skipped once its export exists."""
    configs = _configs(rayjob)
    main, warmups = configs[-1], configs[:-1]
    recipe_model = load_config(ROOT / _trains(rayjob)[-1][0]).model.path
    sft = [c for c in warmups if Path(recipe_model).parent.name == c.name]
    assert sft, f"the entrypoint does not train {recipe_model}, which {main.name} starts from"
    export = f"{sft[0].log.dir}/{sft[0].name}/final"
    assert main.model.path == export
    guards = [c for c in _commands(rayjob) if c[:2] == ["test", "-d"]]
    assert [g[2] for g in guards] == [export], "the warm-up should run only while its export is missing"


def test_placement_fits_the_worker_group(rayjob):
    pytest.importorskip("ray")
    from rltune.runtime.ray.cluster import bundle_specs

    cfg = _main(rayjob)
    bundles, _ = bundle_specs(cfg.runtime.placement)
    pods = [dict(_pod_capacity(g)) for g in _worker_groups(rayjob) for _ in range(int(g["replicas"]))]
    for group in _worker_groups(rayjob):
        replicas = group["replicas"]
        assert group.get("minReplicas", replicas) <= replicas <= group.get("maxReplicas", replicas)
    # the head reserves nothing for actors, so every bundle has to go to a worker
    assert _quantity(_cluster(rayjob)["headGroupSpec"]["rayStartParams"].get("num-cpus", 1)) == 0
    assert sum(b.get("GPU", 0) for b in bundles) <= sum(p["GPU"] for p in pods)
    assert sum(b.get("CPU", 0) for b in bundles) <= sum(p["CPU"] for p in pods)
    # a bundle is placed on one node: first-fit, largest first
    for bundle in sorted(bundles, key=lambda b: (b.get("GPU", 0), b.get("CPU", 0)), reverse=True):
        pod = next((p for p in pods if all(p[k] >= bundle.get(k, 0) for k in ("CPU", "GPU"))), None)
        assert pod is not None, f"no worker pod has room for bundle {bundle} (bundles: {bundles})"
        for k in ("CPU", "GPU"):
            pod[k] -= bundle.get(k, 0)


def test_ray_token_authentication_is_on(rayjob):
    assert _cluster(rayjob).get("authOptions", {}).get("mode") == "token"
    major, minor = (int(x) for x in _cluster(rayjob)["rayVersion"].split(".")[:2])
    assert (major, minor) >= (2, 52), "Ray token authentication needs Ray 2.52 or newer"

    def walk(node: Any):
        if isinstance(node, dict):
            for entry in node.get("env") or []:
                yield entry
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for entry in walk(rayjob):
        if entry.get("name") == "RAY_AUTH_MODE":
            assert str(entry.get("value", "")).lower() != "disabled"
    assert "RAY_AUTH_MODE" not in rayjob["spec"].get("runtimeEnvYAML", "")
    assert not re.search(r"RAY_AUTH_MODE\s*[=:]\s*[\"']?disabled", (DEPLOY / "Dockerfile").read_text(), re.I)


def test_dashboard_stays_inside_the_cluster(rayjob):
    head = _cluster(rayjob)["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress", False)


def test_dashboard_is_reachable_by_the_operator(rayjob):
    """KubeRay submits through, and polls job status from, the dashboard behind the head
    Service. Bound to 127.0.0.1 the job is never submitted (K8sJobMode) or never seen to
    finish; the dashboard is protected by the Ray token instead (test above)."""
    head = _cluster(rayjob)["headGroupSpec"]
    assert head["rayStartParams"].get("dashboard-host", "0.0.0.0") not in ("127.0.0.1", "localhost", "::1")
    container = head["template"]["spec"]["containers"][0]
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert ports.get("dashboard") == 8265


def test_run_volume_is_mounted_at_log_dir_everywhere(rayjob, pvc):
    log_dir = _main(rayjob).log.dir
    for pod in _pods(rayjob):
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod.get("volumes", [])
            if "persistentVolumeClaim" in v
        }
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert log_dir in mounts, f"{container['name']} does not mount the run volume at {log_dir}"
            assert claims.get(mounts[log_dir]) == pvc["metadata"]["name"]
    # the head and the workers are different pods, usually on different nodes
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert pvc["spec"]["resources"]["requests"]["storage"]


def test_rayjob_retries_and_cleans_up(rayjob):
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert int(spec["ttlSecondsAfterFinished"]) > 0
    assert int(spec.get("backoffLimit", 0)) >= 1, "a failed attempt should be resubmitted (and resume)"


def test_containers_have_requests_and_limits(rayjob):
    for container in _containers(rayjob):
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            for key in ("cpu", "memory"):
                assert key in resources.get(kind, {}), f"{container['name']}: no {kind}.{key}"
    for group in _worker_groups(rayjob):
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert _quantity(limits.get("nvidia.com/gpu", 0)) >= 1


def test_pods_run_unprivileged_with_the_project_image(rayjob):
    images = {c["image"] for c in _containers(rayjob)}
    assert len(images) == 1, f"head and workers should run the same image, got {images}"
    for pod in _pods(rayjob):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 1000) != 0
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_no_literal_secrets(rayjob):
    secretish = re.compile(r"TOKEN|SECRET|PASSWORD|API_?KEY|CREDENTIAL", re.I)
    for container in _containers(rayjob):
        for entry in container.get("env") or []:
            if secretish.search(entry["name"]):
                assert "value" not in entry, f"{entry['name']} should come from a Secret (valueFrom)"
    for word, rest in _dockerfile():
        if word in ("ENV", "ARG"):
            assert not secretish.search(rest.split("=")[0]), f"deploy/Dockerfile bakes in {word} {rest}"


def test_image_ray_matches_the_pin(rayjob, pyproject):
    pin = _ray_pin(pyproject)
    image = _base_image()
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-cu\d+", image)
    assert match, f"base image {image!r} is not a rayproject/ray CUDA tag (X.Y.Z-pyNNN-cuNNN)"
    assert match.group(1) == pin, f"base image has Ray {match.group(1)}, pyproject pins ray=={pin}"
    assert _cluster(rayjob)["rayVersion"] == pin
    # the image's Python satisfies the package's requires-python
    floor = re.fullmatch(r">=\s*(\d+)\.(\d+)", pyproject["project"]["requires-python"].strip())
    assert floor and (int(match.group(2)), int(match.group(3))) >= (int(floor.group(1)), int(floor.group(2)))


def test_image_installs_the_package_with_the_ray_extra(pyproject):
    installs = [rest for word, rest in _dockerfile() if word == "RUN" and "pip install" in rest]
    extras = [
        set(m.group(1).replace(" ", "").split(","))
        for r in installs
        for m in re.finditer(r"\.\[([^\]]+)\]", r)
    ]
    assert extras, "deploy/Dockerfile does not `pip install .[...]` the package"
    declared = set(pyproject["project"]["optional-dependencies"])
    assert "ray" in extras[0]
    assert extras[0] <= declared, f"unknown extras {extras[0] - declared}"


def test_image_runs_as_a_user():
    users = [rest for word, rest in _dockerfile() if word == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")


# ------------------------------------------------------------------ .dockerignore


def _ignore_rules() -> list[tuple[bool, re.Pattern]]:
    """deploy/Dockerfile.dockerignore as ``(negated, pattern)``, in order."""
    rules = []
    for line in (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:] if negated else line
        regex, i = "", 0
        pattern = pattern.strip("/")
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negated, re.compile(regex + r"\Z")))
    return rules


def _ignored(path: str) -> bool:
    """Docker's rule: the last pattern matching the path (or a folder above it) wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negated, regex in _ignore_rules():
        if any(regex.match(p) for p in prefixes):
            ignored = not negated
    return ignored


@pytest.mark.parametrize("path", [
    ".venv/bin/python", "runs/arith-grpo/checkpoints/step-50/model.safetensors", ".git/HEAD",
    "rltune/__pycache__/cli.cpython-311.pyc", ".pytest_cache/v/cache/nodeids", "build/lib/rltune/cli.py",
    "rltune.egg-info/PKG-INFO", ".env", "tests/unit/test_deploy.py",
])
def test_build_context_leaves_out(path):
    assert _ignored(path)


def test_build_context_keeps_what_the_image_copies():
    copies = [rest.split() for word, rest in _dockerfile() if word == "COPY"]
    assert copies
    for args in copies:
        sources = [a for a in args[:-1] if not a.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert not _ignored(source), f"COPY {source}: excluded by deploy/Dockerfile.dockerignore"
    assert not _ignored("rltune/cli.py") and not _ignored("recipes/arith-grpo.yaml")
