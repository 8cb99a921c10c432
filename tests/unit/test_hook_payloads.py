"""Every webhook payload shape, validly signed, gets a 2xx or a 4xx that names the problem, never a 5xx: the shapes
that crashed before (MLflow `data` as a list, string or null; `tags` as a list or string; JSON nested very deep),
then property-based payloads (hypothesis; the project's fixed-seed default budget, and a long run:
`LLMC_FUZZ_WEBHOOKS=N pytest -m fuzz_long tests/unit/test_hook_payloads.py`, counts in docs/registry-hook.md).
Also: GET /status answers only a bearer token, and says nothing to anyone else.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="pip install -e '.[dev]' installs hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.unit.fuzz_limits import measured_case  # noqa: E402
from tests.unit.hook_helpers import SECRET, make_receiver, signed_headers, version_created  # noqa: E402

HF_SECRET = "hf-" + SECRET
DEFAULT = dict(derandomize=True, deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large])
LONG = dict(DEFAULT, derandomize=False)


@pytest.fixture
def receiver(tmp_path: Path, monkeypatch):
    return make_receiver(tmp_path, monkeypatch, max_queued=100_000)  # the bound is test_hook's and the load test's


def _mlflow(client, body: bytes):
    return client.post("/webhooks/mlflow", data=body, headers=signed_headers(body))


def _hf(client, body: bytes):
    return client.post("/webhooks/huggingface", data=body,
                       headers={"Content-Type": "application/json", "X-Webhook-Secret": HF_SECRET})


def _event(data) -> bytes:
    return json.dumps({**version_created("tiny", "1"), "data": data}).encode()


# --------------------------------------------------------------------------- the shapes that were 500 on bb4e556


@pytest.mark.parametrize("data", [[], ["tiny", "1"], "tiny", None, 7, True],
                         ids=["empty-list", "list", "string", "null", "number", "bool"])
def test_data_that_is_not_an_object_is_a_400_naming_data(receiver, data) -> None:
    client, queue, _ = receiver
    answer = _mlflow(client, _event(data))
    assert answer.status_code == 400, answer.get_data()
    assert answer.json["error"].startswith("not an MLflow webhook payload: data:")
    assert queue.jobs() == []


@pytest.mark.parametrize("tags", ["llmc.build_id", '{"llmc.build_id": "x"}', ["llmc.build_id"],
                                  [["llmc.build_id", "x"]], {"llmc.build_id": 1}, {"deploy": None}, [{"key": "k"}]],
                         ids=["string", "json-in-a-string", "list-of-strings", "list-of-pairs", "int-value",
                              "null-value", "entry-without-value"])
def test_tags_of_another_shape_are_refused_never_ignored(receiver, tags) -> None:
    client, queue, _ = receiver
    answer = _mlflow(client, _event({"name": "tiny", "version": "1", "tags": tags}))
    assert answer.status_code == 400 and "data.tags" in answer.json["error"], answer.json
    assert queue.jobs() == []


def test_tags_as_mlflows_rest_list_are_read_as_a_map(receiver) -> None:
    client, queue, _ = receiver
    own = _mlflow(client, _event({"name": "tiny", "version": "1", "tags": [{"key": "llmc.build_id", "value": "ab"}]}))
    assert own.status_code == 200 and own.json["ignored"] == "a version llmc registered"
    queued = _mlflow(client, _event({"name": "tiny", "version": 2, "tags": [{"key": "team", "value": "nlp"}]}))
    assert queued.status_code == 202
    (job,) = queue.jobs()
    assert job["source"]["uri"] == "models:/tiny/2" and job["source"]["tags"] == {"team": "nlp"}


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"data": ' * 50_000 + b"1" + b"}" * 50_000, b"\xff\xfe", b"",
                                  b"[]", b"null", b'{"entity": null, "action": "created", "data": {}}',
                                  b'{"entity": "model_version", "action": "created"}'],
                         ids=["deep-list", "deep-object", "not-utf8", "empty", "list", "null", "entity-null",
                              "no-data"])
def test_bodies_that_are_not_an_mlflow_event_are_a_400(receiver, body: bytes) -> None:
    client, queue, _ = receiver
    answer = _mlflow(client, body)
    assert answer.status_code == 400 and answer.json["error"].startswith("not an MLflow webhook payload"), answer.json
    assert queue.jobs() == []


def test_http_errors_are_answered_in_json(receiver) -> None:  # found by the long fuzz run: a 413 was HTML
    client, _, config = receiver
    too_big = _mlflow(client, b"[" * (config.server.max_body_bytes + 1))
    assert too_big.status_code == 413 and too_big.json["error"].startswith("Request Entity Too Large")
    assert client.get("/nowhere").status_code == 404 and "error" in client.get("/nowhere").json
    assert client.get("/webhooks/mlflow").status_code == 405 and "error" in client.get("/webhooks/mlflow").json


@pytest.mark.parametrize("data", [{"name": ["tiny"], "version": "1"}, {"name": "tiny", "version": True},
                                  {"name": "tiny", "version": 1.5}, {"name": "tiny"}, {"version": "1"},
                                  {"name": "tiny", "version": "1.5"}, {"name": "x" * 300, "version": "1"}])
def test_names_and_versions_of_another_type_or_form_are_a_400(receiver, data: dict) -> None:
    client, queue, _ = receiver
    assert _mlflow(client, _event(data)).status_code == 400
    assert queue.jobs() == []


@pytest.mark.parametrize("payload", [[], {"event": None, "repo": {"name": "org/tiny"}},
                                     {"event": {"action": "update", "scope": "repo"}, "repo": ["org/tiny"]},
                                     {"event": {"action": "update", "scope": "repo"}, "repo": {"name": 5}},
                                     {"event": {"action": "update", "scope": 1}, "repo": {"name": "org/tiny"}}])
def test_hub_payloads_of_another_shape_are_a_400(receiver, payload) -> None:
    client, queue, _ = receiver
    answer = _hf(client, json.dumps(payload).encode())
    assert answer.status_code == 400 and answer.json["error"].startswith("not a Hugging Face webhook payload")
    assert queue.jobs() == []


# --------------------------------------------------------------------------- GET /status


def test_status_needs_a_bearer_token_and_tells_nobody_else_anything(receiver, monkeypatch, tmp_path: Path) -> None:
    client, queue, config = receiver
    assert _mlflow(client, _event({"name": "tiny", "version": "4"})).status_code == 202
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SECRET}"},
                    {"Authorization": SECRET}):
        answer = client.get("/status", headers=headers)
        assert answer.status_code == 401 and answer.headers["WWW-Authenticate"].startswith("Bearer")
        assert str(tmp_path) not in answer.get_data(as_text=True) and "jobs" not in answer.json
    for token in (SECRET, HF_SECRET):
        answer = client.get("/status", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200 and answer.json["jobs"][0]["source"] == "models:/tiny/4"

    from llmc.hook.queue import JobQueue
    from llmc.hook.server import create_app

    monkeypatch.setenv("LLMC_HOOK_STATUS_TOKEN", "read-only-token")
    with_token = create_app(config, JobQueue(config.state, config.max_queued), threading.Event())
    answer = with_token.test_client().get("/status", headers={"Authorization": "Bearer read-only-token"})
    assert answer.status_code == 200 and len(answer.json["jobs"]) == 1


# --------------------------------------------------------------------------- property: never a 5xx

_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=20)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=16)
_names = st.sampled_from(["tiny", "tiny-7", "tiny.tiny-w8.vllm-sm90-tp1", "other", "tiny/../x", "", ".tiny",
                          "tiny\x00", "t" * 300]) | st.text(max_size=30) | _json
_versions = st.integers(min_value=-5, max_value=10**13) | st.sampled_from(["1", "007", "1.5", "", "-1"]) \
    | st.text(max_size=14) | _json
_tag_keys = st.sampled_from(["llmc.build_id", "deploy", ""]) | st.text(max_size=16)
_tags = (st.dictionaries(_tag_keys, st.text(max_size=16) | _json, max_size=4)
         | st.lists(st.fixed_dictionaries({"key": _tag_keys, "value": st.text(max_size=16)}) | _json, max_size=4)
         | st.sampled_from(["llmc.build_id", "llmc.build_id=abc", '{"llmc.build_id": "x"}']) | _json)
_data = st.fixed_dictionaries({}, optional={"name": _names, "version": _versions, "tags": _tags,
                                            "source": _json, "run_id": _json, "description": _json}) | _json
_mlflow_wild = st.fixed_dictionaries({}, optional={
    "entity": st.sampled_from(["model_version", "registered_model", "prompt"]) | _json,
    "action": st.sampled_from(["created", "updated", "deleted"]) | _json,
    "timestamp": _json, "data": _data}) | _json
_good_tags = st.dictionaries(_tag_keys, st.text(max_size=16), max_size=3) \
    | st.lists(st.fixed_dictionaries({"key": _tag_keys, "value": st.text(max_size=16)}), max_size=3)
# created events of the right shape, tags drawn from the wild: most reach the routes and the queue
_created = st.fixed_dictionaries({
    "entity": st.just("model_version"), "action": st.just("created"),
    "data": st.fixed_dictionaries({"name": st.sampled_from(["tiny", "tiny-7", "other"]),
                                   "version": st.integers(min_value=1, max_value=10**6).map(str)
                                   | st.integers(min_value=1, max_value=10**6)},
                                  optional={"tags": _good_tags | _tags, "description": _json})})
_mlflow_events = st.one_of(_created, _created, _mlflow_wild)
_hf_wild = st.fixed_dictionaries({}, optional={
    "event": st.fixed_dictionaries({}, optional={"action": st.sampled_from(["create", "update", "delete"]) | _json,
                                                 "scope": st.sampled_from(["repo", "repo.content", "discussion"])
                                                 | _json}) | _json,
    "repo": st.fixed_dictionaries({}, optional={"type": st.sampled_from(["model", "dataset"]) | _json,
                                                "name": st.sampled_from(["org/tiny", "org/../x", "tiny"]) | _names,
                                                "headSha": st.text(max_size=41) | _json}) | _json}) | _json
_hf_events = st.fixed_dictionaries({
    "event": st.fixed_dictionaries({"action": st.sampled_from(["create", "update", "delete"]),
                                    "scope": st.sampled_from(["repo", "repo.content"])}),
    "repo": st.fixed_dictionaries({"type": st.just("model"),
                                   "name": st.sampled_from(["org/tiny", "org/../x"]) | _names},
                                  optional={"headSha": st.text(alphabet="0123456789abcdef", min_size=1, max_size=40)
                                            | _json})}) | _hf_wild


def _encoded(events) -> st.SearchStrategy[bytes]:
    """The events as JSON bytes, sometimes cut short or wrapped in a deep nest, or bytes that are not JSON."""
    text = events.map(lambda e: json.dumps(e).encode())
    cut = st.tuples(text, st.integers(min_value=0, max_value=64)).map(lambda t: t[0][:max(0, len(t[0]) - t[1] - 1)])
    deep = st.tuples(st.integers(min_value=150, max_value=300_000), st.sampled_from([b"[", b'{"data": '])).map(
        lambda t: t[1] * t[0] + b"0" + (b"]" if t[1] == b"[" else b"}") * t[0])
    return st.one_of(*[text] * 7, cut, deep, st.binary(max_size=64))


def _check_mlflow(client, queue, body: bytes) -> None:
    before = {j["id"] for j in queue.jobs()}
    with measured_case("webhook deliveries (MLflow)") as record:
        answer = _mlflow(client, body)
        record["outcome"] = f"HTTP {answer.status_code}"
    event(f"HTTP {answer.status_code}")  # counted by --hypothesis-show-statistics
    assert 200 <= answer.status_code < 500, (answer.status_code, body[:300], answer.get_data()[:300])
    assert answer.is_json and set(answer.json) & {"error", "ignored", "jobs"}
    new = [j for j in queue.jobs() if j["id"] not in before]
    if answer.status_code != 202:
        assert new == []
        return
    data = json.loads(body)["data"]  # a 202 means the payload was a model_version.created event of this shape
    assert json.loads(body)["entity"] == "model_version" and json.loads(body)["action"] == "created"
    assert isinstance(data["name"], str) and str(data["version"]).isdigit() and not isinstance(data["version"], bool)
    tags = data.get("tags") or {}
    assert isinstance(tags, (dict, list))
    tag_map = tags if isinstance(tags, dict) else {t["key"]: t["value"] for t in tags}
    assert "llmc.build_id" not in tag_map
    for job in new:
        assert job["source"]["uri"] == f"models:/{data['name']}/{data['version']}"
        assert job["source"]["tags"] == tag_map


def _check_hf(client, queue, body: bytes) -> None:
    with measured_case("webhook deliveries (Hub)") as record:
        answer = _hf(client, body)
        record["outcome"] = f"HTTP {answer.status_code}"
    event(f"HTTP {answer.status_code}")
    assert 200 <= answer.status_code < 500, (answer.status_code, body[:300], answer.get_data()[:300])
    assert answer.is_json and set(answer.json) & {"error", "ignored", "jobs"}


@settings(max_examples=200, **DEFAULT)
@given(body=_encoded(_mlflow_events))
def test_no_mlflow_payload_gets_a_5xx(receiver, body: bytes) -> None:
    client, queue, _ = receiver
    _check_mlflow(client, queue, body)


@settings(max_examples=60, **DEFAULT)
@given(body=_encoded(_hf_events))
def test_no_hub_payload_gets_a_5xx(receiver, body: bytes) -> None:
    client, queue, _ = receiver
    _check_hf(client, queue, body)


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_WEBHOOKS", 1000)), **LONG)
@given(body=_encoded(_mlflow_events))
def test_no_mlflow_payload_gets_a_5xx_long(receiver, body: bytes) -> None:
    client, queue, _ = receiver
    _check_mlflow(client, queue, body)


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_WEBHOOKS", 1000)), **LONG)
@given(body=_encoded(_hf_events))
def test_no_hub_payload_gets_a_5xx_long(receiver, body: bytes) -> None:
    client, queue, _ = receiver
    _check_hf(client, queue, body)
