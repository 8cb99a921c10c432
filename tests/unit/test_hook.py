"""The registry hook without a registry server: signatures (against MLflow's own signing function), the receiver's
answers and what they do to the durable queue, the queue across a dead worker, name validation, model cards, and the
Hub upload plan (never pretending to reach the Hub)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from llmc.errors import InputError, RegistryError
from llmc.hook import signatures
from llmc.hook.config import load_hook_config
from llmc.hook.jobs import parse_model_uri
from llmc.hook.queue import JobQueue
from llmc.result import EvalId
from tests.unit.hook_helpers import SECRET, make_receiver, signed_delivery, tiny_recipe, version_created


# --------------------------------------------------------------------------- signatures


@pytest.mark.parametrize("payload", [b"{}", "{\"name\": \"caf\u00e9\"}".encode(), b"x" * 5000])
def test_the_signature_is_the_one_mlflow_computes(payload: bytes) -> None:
    delivery = pytest.importorskip("mlflow.webhooks.delivery")
    ours = signatures.mlflow_signature("s3cr\u00e9t", "d-1", "1700000000", payload)
    assert ours == delivery._generate_hmac_signature("s3cr\u00e9t", "d-1", "1700000000", payload.decode())


def test_verify_mlflow_accepts_a_fresh_signed_delivery_and_says_why_it_refuses_others() -> None:
    body, headers = signed_delivery({"a": 1})
    now = int(headers["X-MLflow-Timestamp"])
    assert signatures.verify_mlflow(headers, body, SECRET, now) is None
    assert "does not match" in signatures.verify_mlflow(headers, body, "another secret", now)
    assert "does not match" in signatures.verify_mlflow(headers, body + b" ", SECRET, now)
    assert "missing X-MLflow-Signature" in signatures.verify_mlflow(
        {k: v for k, v in headers.items() if k != "X-MLflow-Signature"}, body, SECRET, now)
    replayed = signatures.verify_mlflow(headers, body, SECRET, now + 301, tolerance_s=300)
    assert "outside the 300 s tolerance" in replayed
    assert "outside" in signatures.verify_mlflow(headers, body, SECRET, now - 301, tolerance_s=300)  # from the future
    assert SECRET not in replayed
    lowered = {k.lower(): v for k, v in headers.items()}
    assert signatures.verify_mlflow(lowered, body, SECRET, now) is None


def test_verify_hf_compares_the_shared_secret() -> None:
    assert signatures.verify_hf({"X-Webhook-Secret": SECRET}, SECRET) is None
    assert signatures.verify_hf({"X-Webhook-Secret": "nope"}, SECRET) == "X-Webhook-Secret does not match"
    assert signatures.verify_hf({}, SECRET) == "missing X-Webhook-Secret"


# --------------------------------------------------------------------------- the receiver and the queue


@pytest.fixture
def receiver(tmp_path: Path, monkeypatch):
    """(Flask test client, queue, config) with both receivers on and no worker: what a delivery leaves queued."""
    return make_receiver(tmp_path, monkeypatch, max_queued=2)


def _post(client, payload: dict, **kw):
    body, headers = signed_delivery(payload, **kw)
    return client.post("/webhooks/mlflow", data=body, headers=headers)


def test_a_delivery_queues_one_job_and_its_duplicate_queues_nothing(receiver) -> None:
    client, queue, _ = receiver
    first = _post(client, version_created("tiny", "3"), delivery_id="d-1")
    again = _post(client, version_created("tiny", "3"), delivery_id="d-1")  # MLflow's retry: same delivery
    other = _post(client, version_created("tiny", "3"), delivery_id="d-2")  # a second webhook, same event
    assert first.status_code == 202 and first.json["jobs"][0]["new"] is True
    assert again.status_code == other.status_code == 202
    assert again.json["jobs"][0]["new"] is other.json["jobs"][0]["new"] is False
    jobs = queue.jobs()
    assert len(jobs) == 1 and jobs[0]["state"] == "queued" and jobs[0]["deliveries"] == ["d-1", "d-2"]
    assert jobs[0]["source"]["uri"] == "models:/tiny/3"
    assert jobs[0]["recipe"]["model"] == {"source": "models:/tiny/3", "dtype": "float32", "name": "tiny"}


@pytest.mark.parametrize("tamper", ["secret", "body", "no-signature", "replayed", "future"])
def test_a_bad_signature_or_an_old_timestamp_is_401_and_queues_nothing(tamper: str, receiver, capsys) -> None:
    client, queue, _ = receiver
    kw = {"secret": "wrong"} if tamper == "secret" else {}
    if tamper in ("replayed", "future"):
        kw["timestamp"] = int(time.time()) + (-3600 if tamper == "replayed" else 3600)
    body, headers = signed_delivery(version_created("tiny", "4"), **kw)
    if tamper == "body":
        body = body.replace(b'"4"', b'"5"')
    if tamper == "no-signature":
        del headers["X-MLflow-Signature"]
    answer = client.post("/webhooks/mlflow", data=body, headers=headers)
    assert answer.status_code == 401
    assert queue.jobs() == [] and not list(queue.dir.iterdir())
    err = capsys.readouterr().err
    assert "refused MLflow delivery" in err and SECRET not in err


def test_deliveries_that_are_not_for_the_hook_are_ignored_or_refused(receiver) -> None:
    client, queue, _ = receiver
    assert _post(client, version_created("other-model", "1")).json["ignored"] == "no route for other-model"
    own = _post(client, version_created("tiny.tiny-w8.vllm-sm90-tp1", "1", {"llmc.build_id": "ab"}))
    assert own.status_code == 200 and own.json["ignored"] == "a version llmc registered"
    assert _post(client, {**version_created("tiny", "1"), "action": "updated"}).status_code == 200
    for name, version in (("tiny/../../etc", "1"), ("tiny", "1/../2"), ("tiny\x1b[2J", "1")):
        assert _post(client, version_created(name, version)).status_code in (200, 400)
    assert queue.jobs() == []


def test_a_full_queue_answers_503_with_retry_after(receiver) -> None:
    client, queue, _ = receiver
    assert _post(client, version_created("tiny", "1")).status_code == 202
    assert _post(client, version_created("tiny", "2")).status_code == 202
    full = _post(client, version_created("tiny", "3"))
    assert full.status_code == 503 and full.headers["Retry-After"] == "60"
    assert len(queue.jobs()) == 2
    queue.update(queue.jobs()[0]["id"], state="done")  # finished jobs do not count against the bound
    assert _post(client, version_created("tiny", "3")).status_code == 202


def test_the_hf_receiver_checks_its_secret_header(receiver, tmp_path: Path) -> None:
    client, queue, config = receiver
    payload = {"event": {"action": "update", "scope": "repo.content"},
               "repo": {"type": "model", "name": "org/tiny-chat", "headSha": "abc123"}}
    assert client.post("/webhooks/huggingface", json=payload,
                       headers={"X-Webhook-Secret": "wrong"}).status_code == 401
    assert queue.jobs() == []
    answer = client.post("/webhooks/huggingface", json=payload, headers={"X-Webhook-Secret": "hf-" + SECRET})
    assert answer.status_code == 200 and answer.json["ignored"] == "no route for org/tiny-chat"  # routes: tiny*
    payload["repo"]["name"] = "org/../x"
    assert client.post("/webhooks/huggingface", json=payload,
                       headers={"X-Webhook-Secret": "hf-" + SECRET}).status_code == 400


def test_a_job_left_running_by_a_dead_worker_is_queued_again(tmp_path: Path) -> None:
    queue = JobQueue(tmp_path / "state")
    job, new = queue.enqueue({"id": "a" * 64, "source": {"uri": "models:/tiny/1"}, "recipe_path": "r.yaml"})
    assert new and queue.take()["state"] == "running"
    assert queue.take() is None
    assert queue.enqueue({"id": "a" * 64, "source": {}, "recipe_path": "r.yaml"})[1] is False
    restarted = JobQueue(tmp_path / "state")  # as a new process sees the folder
    with restarted.worker_lock():
        assert restarted.recover() == ["a" * 64]
    again = restarted.take()
    assert again["id"] == "a" * 64 and again["attempts"] == 2


@pytest.mark.parametrize("uri", ["models:/a/../b/1", "models:/tiny/one", "models:/.hidden/1", "hf:org/name/x@main",
                                 "hf:org/na me@main", "hf:org/name@../../x", "s3://bucket/model"])
def test_model_uris_that_could_escape_a_folder_are_refused(uri: str) -> None:
    with pytest.raises(InputError):
        parse_model_uri(uri)


def test_secrets_come_from_the_environment_or_a_file_never_the_config(tmp_path: Path, monkeypatch) -> None:
    from llmc.hook.config import secret

    monkeypatch.delenv("LLMC_HOOK_MLFLOW_SECRET", raising=False)
    assert secret("LLMC_HOOK_MLFLOW_SECRET") is None
    (tmp_path / "s").write_text(" from-file \n")
    monkeypatch.setenv("LLMC_HOOK_MLFLOW_SECRET_FILE", str(tmp_path / "s"))
    assert secret("LLMC_HOOK_MLFLOW_SECRET") == "from-file"
    monkeypatch.setenv("LLMC_HOOK_MLFLOW_SECRET", "both")
    with pytest.raises(InputError, match="both"):
        secret("LLMC_HOOK_MLFLOW_SECRET")
    (tmp_path / "hook.yaml").write_text(yaml.safe_dump({"secret": "x", "routes": []}))
    with pytest.raises(Exception, match="secret"):
        load_hook_config(tmp_path / "hook.yaml")


# --------------------------------------------------------------------------- model card and Hub plan


@pytest.fixture(scope="module")
def tiny_entry(tmp_path_factory, tiny_model_session: Path):
    """A published tiny build whose source card says `license: mit`."""
    from llmc.build import build
    from llmc.recipe.load import load_recipe
    from llmc.storage.store import Store
    from tests.unit.build_helpers import small_corpus_file, use_corpus_file

    tmp = tmp_path_factory.mktemp("card")
    model = tmp / "model"
    import shutil

    shutil.copytree(tiny_model_session, model)
    (model / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# a tiny model\n")
    mp = pytest.MonkeyPatch()
    use_corpus_file(small_corpus_file(tmp / "corpus.json"), mp.setattr)
    try:
        recipe = load_recipe(tiny_recipe(tmp / "recipe.yaml", tmp / "registry"))
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"source": str(model),
                                                                                     "name": "tiny"})})
        result = build(recipe, Store(tmp / "cache"))
    finally:
        mp.undo()
    assert result.passed and result.published is not None
    return result


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text[4:].split("\n---\n", 1)[0])


def test_every_published_artifact_has_a_model_card_in_the_manifest(tiny_entry) -> None:
    from llmc.publish.local import read_manifest, verify_entry

    entry = tiny_entry.published
    card = entry / "artifacts" / "vllm-sm90-tp1" / "README.md"
    meta = _front_matter(card.read_text())
    assert meta["base_model"] == "tiny" and meta["base_model_relation"] == "quantized"
    assert meta["license"] == "mit"  # inherited from the source's card
    assert meta["library_name"] == "transformers"
    evaluation = tiny_entry.evals[EvalId("torch", "vllm-sm90-tp1")]
    metrics = {m["type"]: m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]}
    assert metrics["perplexity"] == round(evaluation.perplexity, 4)
    assert metrics["kl_divergence"] == round(evaluation.kld["mean"], 6)
    text = card.read_text()
    assert tiny_entry.build_id in text and "vllm serve" in text and "## Calibration" in text
    assert f"{evaluation.ppl_change['ci_low_pct']:+.2f}" in text  # results with their intervals
    assert read_manifest(entry)["files"]["artifacts/vllm-sm90-tp1/README.md"]
    assert verify_entry(entry) == []


def test_the_hub_upload_plan_puts_one_artifact_at_the_root_on_a_branch_per_build(tiny_entry) -> None:
    from llmc.publish.hub import upload_plan

    plan = upload_plan(tiny_entry.published, "org/tiny-w8")
    paths = dict(plan.files)
    assert plan.revision == f"llmc-{tiny_entry.build_id}"
    assert {"README.md", "config.json", "model.safetensors", "llmc/manifest.json", "llmc/report.md"} <= set(paths)
    assert all(p.is_file() and tiny_entry.published in p.parents for p in paths.values())
    assert not any(p.startswith("/") or ".." in p.split("/") for p in paths)


def test_the_hub_plan_refuses_a_modified_entry(tiny_entry, tmp_path: Path) -> None:
    import shutil

    from llmc.publish.hub import upload_plan

    copy = tmp_path / "entry"
    shutil.copytree(tiny_entry.published, copy)
    (copy / "artifacts" / "vllm-sm90-tp1" / "config.json").write_text("{}")
    with pytest.raises(InputError, match="does not match its manifest"):
        upload_plan(copy, "org/tiny-w8")


def test_pushing_to_an_unreachable_hub_is_a_clear_registry_error(tiny_entry, monkeypatch) -> None:
    from llmc.publish.hub import push, upload_plan
    from tests.unit.hook_helpers import free_port

    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_never_printed")
    plan = upload_plan(tiny_entry.published, "org/tiny-w8")
    started = time.monotonic()
    with pytest.raises(RegistryError) as caught:
        push(plan, endpoint=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert "org/tiny-w8" in caught.value.message and "unreachable" in caught.value.message
    assert "hf_secret_token_never_printed" not in str(caught.value)
    assert time.monotonic() - started < 60


def test_a_recipe_names_its_hub_repository_as_org_slash_name() -> None:
    from pydantic import ValidationError

    from llmc.recipe.schema import PublishSection

    assert PublishSection(hub="org/name").hub == "org/name"
    for bad in ("name", "org/../x", "org/name/extra", "-org/name"):
        with pytest.raises(ValidationError):
            PublishSection(hub=bad)
