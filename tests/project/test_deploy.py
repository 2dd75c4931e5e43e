"""deploy/: the Dockerfile, the KubeRay RayService and the Ray Serve config, checked without
Docker, Kubernetes or a Ray cluster.

What the files promise and these tests hold them to: the manifest and its ``serveConfigV2``
parse and pass Ray Serve's own schema; the application's ``import_path`` imports to the
builder, and its ``args`` build the application (as Ray calls builders); the image installs
torch at the ``constraints-ci.txt`` pin from the CPU index, compiles nothing with
``-march=native`` and ``COPY``s only paths that exist and that ``.dockerignore`` lets in; the
README's commands name the image the manifest runs. Ray-dependent checks skip without Ray.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
MANIFEST = DEPLOY / "kuberay" / "rayservice.yaml"
SERVE_CONFIG = DEPLOY / "serve-config.yaml"
README = DEPLOY / "README.md"
DOCKERIGNORE = ROOT / ".dockerignore"
CONSTRAINTS = ROOT / "constraints-ci.txt"
BUILDER = "flashspec.cluster.app:build"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# An sdist carries tests/ but not deploy/ (MANIFEST.in grafts neither deploy/ nor docs/).
pytestmark = pytest.mark.skipif(not DEPLOY.is_dir(), reason="no deploy/ in this tree")


# ------------------------------------------------------------------ helpers


def manifest() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]
    assert len(docs) == 1, f"{MANIFEST.name}: expected one document, found {len(docs)}"
    doc: dict[str, Any] = docs[0]
    return doc


def serve_configs() -> dict[str, dict[str, Any]]:
    """Every Ray Serve config in deploy/: the manifest's serveConfigV2 and serve-config.yaml."""
    v2 = manifest()["spec"]["serveConfigV2"]
    assert isinstance(v2, str), "serveConfigV2 must be a string (a YAML block scalar)"
    return {
        "serveConfigV2": yaml.safe_load(v2),
        "serve-config.yaml": yaml.safe_load(SERVE_CONFIG.read_text()),
    }


def flashspec_app(config: dict[str, Any]) -> dict[str, Any]:
    apps = [a for a in config["applications"] if a.get("import_path") == BUILDER]
    assert len(apps) == 1, f"expected one application with import_path {BUILDER}: {config}"
    return apps[0]


CONFIG_NAMES = ["serveConfigV2", "serve-config.yaml"]


def constraint_pin(package: str) -> str:
    for line in CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep and name.strip().lower() == package:
            return version.strip()
    raise AssertionError(f"{package} is not pinned in {CONSTRAINTS.name}")


def instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments): continuation lines joined,
    comment lines dropped (Docker drops them inside a continued instruction too)."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not current):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued instruction"
    return out


def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (negated, regex), in order (the last matching pattern decides)."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        parts = pattern.strip("/").split("/")
        for i, part in enumerate(parts):
            if part == "**":
                out += "(?:[^/]+/)*" if i < len(parts) - 1 else ".*"
                continue
            seg = re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            seg = re.sub(r"\\\[(.*?)\\\]", lambda m: "[" + m.group(1) + "]", seg)
            out += seg + ("/" if i < len(parts) - 1 else "")
        return re.compile(out + r"\Z")

    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        rules.append((negated, regex(line.lstrip("!"))))
    return rules


def excluded(path: str) -> bool:
    """Whether Docker leaves ``path`` (relative to the context) out: a pattern that matches the
    path or one of its parent folders excludes it, unless a later ``!`` pattern matches."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for negated, pattern in ignore_patterns():
        if any(pattern.match(c) for c in candidates):
            verdict = not negated
    return verdict


def copy_sources() -> list[str]:
    """The local paths the Dockerfile COPYs (COPY --from=stage copies from a stage, not the
    context, and is left out)."""
    sources = []
    for keyword, args in dockerfile():
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(args)
        if any(w.startswith("--from") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        assert len(paths) >= 2, f"{keyword} {args}: needs a source and a destination"
        sources += paths[:-1]
    return sources


def cpus(quantity: Any) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


# ------------------------------------------------------------------ the manifest


def test_manifest_is_a_rayservice() -> None:
    doc = manifest()
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == "RayService"
    assert doc["metadata"]["name"]
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert cluster["workerGroupSpecs"], "no worker group"


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_serve_config_names_the_builder(name: str) -> None:
    app = flashspec_app(serve_configs()[name])
    assert app["route_prefix"] == "/"
    assert isinstance(app["args"], dict) and app["args"], "the application has no args"


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_serve_config_passes_ray_serves_schema(name: str) -> None:
    schema = pytest.importorskip("ray.serve.schema")
    parsed = schema.ServeDeploySchema.model_validate(serve_configs()[name])
    assert [a.import_path for a in parsed.applications if a.import_path == BUILDER]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_import_paths_resolve_to_callables(name: str) -> None:
    """Every application's import_path (not only the one named ``BUILDER``) imports, as Ray's
    ``import_attr`` would, to a callable."""
    pytest.importorskip("ray")
    for app in serve_configs()[name]["applications"]:
        module_name, sep, attr = app["import_path"].partition(":")
        assert sep and attr, f"{app['import_path']}: expected module:attribute"
        builder = getattr(importlib.import_module(module_name), attr)
        assert callable(builder), f"{app['import_path']} is not callable"


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_args_are_settings(name: str) -> None:
    """``ClusterSettings.from_dict`` accepts the args (no Ray needed), and each has the type of
    its field: YAML's ``off`` is False and a quoted ``"2"`` a string, which ``from_dict`` alone
    does not catch for every field."""
    from flashspec.cluster.settings import ClusterSettings
    from flashspec.options import EngineOptions, compile_setting

    args = flashspec_app(serve_configs()[name])["args"]
    settings = ClusterSettings.from_dict(dict(args))
    compile_setting(settings.engine.compile)  # raises UserError for anything but auto/on/off
    defaults = {f.name: f.default for f in fields(EngineOptions)}
    defaults |= {f.name: f.default for f in fields(ClusterSettings) if f.name != "engine"}
    for key, value in args.items():
        default = defaults[key]
        if default is None or value is None:
            continue
        allowed = (int, float) if type(default) is float else (type(default),)
        assert type(value) in allowed, (
            f"{name}: args.{key} is {value!r} ({type(value).__name__}), expected "
            f"{type(default).__name__} like its default {default!r}"
        )


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_args_build_the_application(name: str) -> None:
    """Through the function Ray Serve itself calls builders with (``serve run``, ``serve
    deploy``, KubeRay's config): one parameter, a plain function, returning an Application."""
    pytest.importorskip("ray.serve")
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app = flashspec_app(serve_configs()[name])
    module_name, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module_name), attr)
    built = call_user_app_builder_with_args_if_necessary(builder, dict(app["args"]))
    assert isinstance(built, Application)


def test_serve_run_key_value_strings() -> None:
    """``serve run flashspec.cluster.app:build key=val``: Ray passes every value as a string.
    String settings work; deploy/README.md says numbers do not, and this holds it to that."""
    pytest.importorskip("ray.serve")
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.scripts import convert_args_to_dict

    from flashspec.cluster.app import build

    ok = convert_args_to_dict(("target=demo", "compile=off"))
    assert call_user_app_builder_with_args_if_necessary(build, ok) is not None


def test_serve_run_key_value_numbers() -> None:
    pytest.importorskip("ray.serve")
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.scripts import convert_args_to_dict

    from flashspec.cluster.app import build
    from flashspec.cluster.settings import ClusterSettings
    from flashspec.options import UserError

    text = ("target=demo", "replicas=2", "replica_cpus=1", "compile=off", "max_replicas=none")
    args = convert_args_to_dict(text)
    assert call_user_app_builder_with_args_if_necessary(build, args) is not None
    settings = ClusterSettings.from_dict(args)
    assert (settings.replicas, settings.replica_cpus, settings.max_replicas) == (2, 1.0, None)
    assert settings.engine.compile == "off"
    with pytest.raises(UserError, match="replicas: cannot read 'two' as int"):
        ClusterSettings.from_dict(convert_args_to_dict(("replicas=two",)))


def test_cluster_has_room_for_the_replicas() -> None:
    """Ray would wait forever for replicas it cannot place: the workers' CPUs (KubeRay gives
    each pod its CPU limit as Ray CPUs; the head has num-cpus 0) must hold them all."""
    doc = manifest()
    cluster = doc["spec"]["rayClusterConfig"]
    assert cpus(cluster["headGroupSpec"]["rayStartParams"].get("num-cpus", 1)) == 0
    room = sum(
        group["replicas"]
        * cpus(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
        for group in cluster["workerGroupSpecs"]
    )
    args = flashspec_app(serve_configs()["serveConfigV2"])["args"]
    replicas = max(args.get("replicas", 2), args.get("max_replicas") or 0)
    need = replicas * float(args.get("replica_cpus", 1.0))
    assert need <= room, f"{replicas} replicas x {args.get('replica_cpus', 1.0)} CPU > {room} CPUs"


def test_pods_run_the_image_as_it_is_built() -> None:
    doc = manifest()
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == constraint_pin("ray"), "rayVersion differs from the image's ray"
    images = {c["image"] for c in containers(doc)}
    assert len(images) == 1, f"head and workers run different images: {images}"
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        # The CRD types rayStartParams as a map of strings.
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), params
        uid = group["template"]["spec"]["securityContext"]["runAsUser"]
        assert ("USER", f"{uid}:{uid}") in dockerfile() or ("USER", str(uid)) in dockerfile()
    for container in containers(doc):
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) <= set(resources["limits"]), (
            container
        )
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {8000, 8265, 6379} <= {p["containerPort"] for p in head["ports"]}


# ------------------------------------------------------------------ the Dockerfile


def test_dockerfile_installs_the_pinned_cpu_torch() -> None:
    runs = [args for keyword, args in dockerfile() if keyword == "RUN" and "torch==" in args]
    assert len(runs) == 1, f"expected one RUN installing torch==..., found {runs}"
    words = shlex.split(runs[0])
    pins = [w for w in words if w.startswith("torch==")]
    assert pins == [f"torch=={constraint_pin('torch')}"], f"{pins} vs {CONSTRAINTS.name}"
    assert words[words.index("--index-url") + 1] == TORCH_CPU_INDEX, runs[0]


def test_dockerfile_installs_the_wheel_with_extras_under_the_constraints() -> None:
    runs = [args for keyword, args in dockerfile() if keyword == "RUN" and ".whl" in args]
    assert any("[ray,gguf]" in r and "-c /tmp/constraints-ci.txt" in r for r in runs), runs
    assert ("COPY", "constraints-ci.txt /tmp/constraints-ci.txt") in dockerfile()


def test_dockerfile_never_targets_the_build_machine() -> None:
    assert "-march=native" not in DOCKERFILE.read_text()
    assert "-march=native" not in DOCKERIGNORE.read_text()


def test_dockerfile_stages_and_user() -> None:
    steps = dockerfile()
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    bases = [a.split()[0] for k, a in steps if k == "FROM"]
    resolved = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], b) for b in bases]
    assert len(resolved) >= 2 and set(resolved) == {"python:3.11-slim-bookworm"}, resolved
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    exposed = {int(p) for k, a in steps if k == "EXPOSE" for p in a.split()}
    assert {8000, 8265, 6379} <= exposed


def test_dockerfile_cmd_is_a_valid_flashspec_serve() -> None:
    from flashspec.cli import build_parser

    cmds = [a for k, a in dockerfile() if k == "CMD"]
    assert len(cmds) == 1
    argv = json.loads(cmds[0])  # the exec form: no shell in between
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts
    parsed = build_parser().parse_args(argv[1:])
    assert parsed.command == "serve" and parsed.host == "0.0.0.0", argv


def test_every_copied_path_exists_and_is_in_the_context() -> None:
    sources = copy_sources()
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        assert not excluded(source), f"COPY {source}: .dockerignore leaves it out of the context"


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (
        ".git/HEAD",
        "benchmarks/results",
        "docs/replicas.md",
        "tests/conftest.py",
        "wheels/dist/x.whl",
        "flashspec/_residual.abi3.so",
        "flashspec/__pycache__/cli.cpython-311.pyc",
        ".venv/bin/python",
    ):
        assert excluded(path), f"{path} would be sent to the Docker daemon"
    for path in ("flashspec/__init__.py", "flashspec/demo/target/config.json", "asm/x.asm"):
        assert not excluded(path), f"{path} would be missing from the build"


# ------------------------------------------------------------------ the README


def image_tags(text: str) -> set[str]:
    tags = set(re.findall(r"docker build\b[^\n]*?\s-t\s+(\S+)", text))
    tags |= set(re.findall(r"kind load docker-image\s+(\S+)", text))
    tags |= set(re.findall(r"minikube image load\s+(\S+)", text))
    return tags


def test_readme_builds_the_image_the_manifest_runs() -> None:
    text = README.read_text()
    images = {c["image"] for c in containers(manifest())}
    assert image_tags(text) and image_tags(text) == images, (image_tags(text), images)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert {i.rsplit(":", 1)[1] for i in images} == {version}, "the tag is not the version"
    # The Dockerfile's and the manifest's own comments show the same build command.
    for path in (DOCKERFILE, MANIFEST):
        assert image_tags(path.read_text()) == images, path
    assert BUILDER in text and "x-flashspec-replica" in text


def test_readme_links_resolve() -> None:
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path = (README.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"deploy/README.md links to {target}: no such file"
