"""The Kubernetes runner against the Kubernetes OpenAPI schema and the API server's answers, without a cluster.

The schema is a fragment of the official client's own copy (kubernetes-client/python v36.0.3,
kubernetes/swagger.json.unprocessed), cut by scripts/k8s_schema_fragment.py: batch/v1 Job and everything it reaches.
The manifest `job_manifest` writes is validated against it, strictly (a key the schema does not define is an
error: the API server would drop it silently). The runner then drives the real client (BatchV1Api, CoreV1Api over
a real ApiClient) whose HTTP pool answers from tests/unit/data/k8s_job_responses.json; every request's method, path,
query and body is checked, and every answer's body is itself checked against the schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmc.hook.config import KubernetesSection, load_hook_config
from llmc.hook.runners import Needs, dispatch, follow, job_manifest
from tests.unit.hook_helpers import hook_config, tiny_recipe

DATA = Path(__file__).parent / "data"
SCHEMA = json.loads((DATA / "k8s_batch_v1_job.schema.json").read_text())["definitions"]
JOB = "io.k8s.api.batch.v1.Job"
K8S = KubernetesSection(namespace="ml", image="ghcr.io/example/llmc:1", state_claim="llmc-state",
                        cache_claim="llmc-cache")
NEEDS = Needs(host_gb=12, gpu_gb=None, disk_gb=200, seconds=3600, gpus_per_rank=1)
JOB_ID = "ab" * 32
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}


def schema_errors(value: object, schema: dict, where: str = "$") -> list[str]:
    """Where `value` breaks a Swagger 2.0 schema node (the keywords the fragment uses: $ref, type, format
    int-or-string, properties, required, items, additionalProperties); unknown keys are errors."""
    if "$ref" in schema:
        return schema_errors(value, SCHEMA[schema["$ref"].rsplit("/", 1)[-1]], where)
    kind = schema.get("type")
    if schema.get("format") == "int-or-string" and isinstance(value, int):
        kind = "integer"
    if kind and (not isinstance(value, _TYPES[kind]) or (kind in ("integer", "number") and isinstance(value, bool))):
        return [f"{where}: {type(value).__name__} {value!r:.40}, the schema wants {kind}"]
    errors = []
    if isinstance(value, dict):
        errors += [f"{where}: {key!r} is required" for key in schema.get("required", ()) if key not in value]
        fields, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, item in value.items():
            if key in fields:
                errors += schema_errors(item, fields[key], f"{where}.{key}")
            elif extra:
                errors += schema_errors(item, extra, f"{where}.{key}")
            else:
                errors.append(f"{where}: {key!r} is not a field of this object")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors


def test_the_schema_fragment_is_the_clients_own() -> None:
    pytest.importorskip("kubernetes.client")
    from kubernetes import client

    # the generated models are built from the same file: each definition's fields are the model's attribute_map
    for definition, model in ((JOB, client.V1Job), ("io.k8s.api.batch.v1.JobSpec", client.V1JobSpec),
                              ("io.k8s.api.core.v1.Container", client.V1Container),
                              ("io.k8s.api.core.v1.PodSpec", client.V1PodSpec)):
        assert set(SCHEMA[definition]["properties"]) == set(model.attribute_map.values()), definition


def test_the_job_manifest_is_valid_against_the_openapi_schema() -> None:
    manifest = job_manifest({"id": JOB_ID}, NEEDS, K8S)
    assert schema_errors(manifest, {"$ref": JOB}) == []
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"memory": f"{15 * 1024}Mi", "nvidia.com/gpu": "1"}


@pytest.mark.parametrize("break_it, error", [
    (lambda m: m["spec"]["template"]["spec"]["containers"][0].pop("name"),
     "$.spec.template.spec.containers[0]: 'name' is required"),
    (lambda m: m["spec"].update(activeDeadlineSeconds="5400"),
     "$.spec.activeDeadlineSeconds: str '5400', the schema wants integer"),
    (lambda m: m["spec"].update(backofLimit=0), "$.spec: 'backofLimit' is not a field of this object"),
    (lambda m: m["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update({"memory": 15}),
     "$.spec.template.spec.containers[0].resources.limits.memory: int 15, the schema wants string"),
    (lambda m: m["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"].pop("claimName"),
     "$.spec.template.spec.volumes[0].persistentVolumeClaim: 'claimName' is required"),
])
def test_a_broken_manifest_is_refused_where_it_breaks(break_it, error: str) -> None:
    manifest = job_manifest({"id": JOB_ID}, NEEDS, K8S)
    break_it(manifest)
    assert schema_errors(manifest, {"$ref": JOB}) == [error]


EXCHANGES = json.loads((DATA / "k8s_job_responses.json").read_text())["exchanges"]


@pytest.mark.parametrize("exchange", EXCHANGES, ids=lambda e: f"{e['call']}-{e['status']}")
def test_each_recorded_answer_is_valid_against_the_schema(exchange: dict) -> None:
    if exchange["schema"]:
        assert schema_errors(exchange["body"], {"$ref": exchange["schema"]}) == []


class _Answer:
    """What the client's RESTResponse reads from urllib3's response."""

    def __init__(self, exchange: dict):
        body = exchange["body"]
        self.status, self.reason = exchange["status"], exchange["reason"]
        self.data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.headers = {"Content-Type": "text/plain" if isinstance(body, str) else "application/json"}

    def getheaders(self) -> dict:
        return self.headers

    def getheader(self, name: str, default=None):
        return self.headers.get(name, default)


class _RecordedServer:
    """urllib3's PoolManager, answering the fixture's exchanges in order and keeping the requests made."""

    def __init__(self, exchanges: list[dict]):
        self.exchanges, self.requests = list(exchanges), []

    def request(self, method, url, body=None, fields=None, headers=None, **_):
        from urllib.parse import parse_qsl, urlsplit

        split = urlsplit(url)  # GET's query comes as fields, the others' in the URL
        query = [list(q) for q in parse_qsl(split.query)] + [list(f) for f in fields or ()]
        self.requests.append({"method": method, "path": split.path, "query": query,
                              "body": json.loads(body) if body else None})
        return _Answer(self.exchanges.pop(0))


@pytest.fixture
def recorded(tmp_path: Path):
    """(runner, server, queue, job): KubernetesRunner on the real client, its HTTP answered from the fixture."""
    pytest.importorskip("kubernetes.client")
    from kubernetes import client

    from llmc.hook.jobs import hf_source, new_job
    from llmc.hook.queue import JobQueue
    from llmc.hook.runners import KubernetesRunner
    from llmc.recipe.load import load_recipe

    configuration = client.Configuration(host="https://k8s.example:6443")
    api = client.ApiClient(configuration)
    server = _RecordedServer(EXCHANGES)
    api.rest_client.pool_manager = server
    recipe = tiny_recipe(tmp_path / "recipe.yaml", tmp_path / "registry")
    config = load_hook_config(hook_config(tmp_path / "hook.yaml", "http://127.0.0.1:9", recipe)).model_copy(
        update={"kubernetes": K8S})
    runner = KubernetesRunner(config, needs_for=lambda job: NEEDS, api=(client.BatchV1Api(api), client.CoreV1Api(api)))
    queue = JobQueue(config.state)
    job = dict(new_job(load_recipe(recipe), recipe, hf_source("org/tiny", "main")), id=JOB_ID)  # the fixture's id
    queue.enqueue(job)
    return runner, server, queue, queue.take(JOB_ID)


def test_the_client_calls_match_the_api_servers_answers(recorded) -> None:
    runner, server, queue, job = recorded
    name = f"llmc-{JOB_ID[:16]}"
    assert dispatch(runner, job, queue)["scheduler_id"] == name  # POST: 201 Created
    follow(runner, queue)  # GET .../status: active 1
    assert queue.get(JOB_ID)["scheduler_state"] == "RUNNING"
    follow(runner, queue)  # GET .../status: failed 1 (BackoffLimitExceeded); the pod's log collected
    ended = queue.get(JOB_ID)
    assert ended["state"] == "failed" and ended["scheduler_state"] == "FAILED"
    assert "the kubernetes job" in ended["error"] and "ended FAILED" in ended["error"]
    assert ended["error"].endswith("its log ends: llmc: building tiny-w8\nKilled\n"), ended["error"]  # the raw log
    assert runner.submit(job) == name  # 409 AlreadyExists: the Job is followed, not an error
    runner.cancel(name)  # DELETE, background propagation
    assert server.exchanges == []  # every recorded answer was asked for, in order
    expected = [{k: e[k] for k in ("method", "path")} | {"query": e.get("query", [])} for e in EXCHANGES]
    made = [{k: r[k] for k in ("method", "path")} | {"query": [q for q in r["query"] if q[0] != "pretty"]}
            for r in server.requests]
    assert made == expected
    manifest = job_manifest(job, NEEDS, K8S)
    posts = [r["body"] for r in server.requests if r["method"] == "POST"]
    assert posts == [manifest, manifest] and schema_errors(posts[0], {"$ref": JOB}) == []
