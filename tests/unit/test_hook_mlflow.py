"""The registry hook against a real MLflow server (SQLite backend, local artifact store, loopback port): MLflow's own
webhook delivery starts `llmc hook serve`'s build of a tiny random model, and the variant appears in the registry
with metrics, gate tags, lineage and model card; duplicates register nothing more; a bad signature queues nothing;
SIGKILL mid-build or between upload and registration, then restart, registers exactly once, with a clean build's
bytes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mlflow")

from tests.unit.build_helpers import published_artifact_hashes, small_corpus_file, use_corpus_file  # noqa: E402
from tests.unit.hook_helpers import (SECRET, hook_config, post, register_source_version, signed_delivery,  # noqa: E402
                                     start_hook, start_mlflow, tiny_recipe, version_created, wait_jobs)

pytestmark = pytest.mark.heavy  # an MLflow server and whole builds behind the hook, ~1 min a test

VARIANT = "tiny-w8.vllm-sm90-tp1"  # <recipe>.<target label>, after the source model's name


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    proc, uri = start_mlflow(tmp_path_factory.mktemp("mlflow"))
    yield uri
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return small_corpus_file(tmp_path_factory.mktemp("hook-corpus") / "corpus.json")


@pytest.fixture(scope="module")
def source_model(tmp_path_factory, tiny_model_session: Path) -> Path:
    model = tmp_path_factory.mktemp("source") / "model"
    shutil.copytree(tiny_model_session, model)
    (model / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return model


class Hook:
    """`llmc hook serve` in a child, with its MLflow webhook; stopped (and the webhook deleted) at the end."""

    def __init__(self, root: Path, mlflow_uri: str, corpus: Path, models: str, kill_at: str = "-") -> None:
        from mlflow import MlflowClient

        root.mkdir(parents=True, exist_ok=True)
        recipe = tiny_recipe(root / "recipe.yaml", root / "unused-registry")
        self.config = hook_config(root / "hook.yaml", mlflow_uri, recipe, models=models)
        self.root, self.corpus, self.log = root, corpus, root / "hook.log"
        self.client = MlflowClient(mlflow_uri)
        self.start(kill_at)

    def start(self, kill_at: str = "-") -> None:
        self.proc, self.url = start_hook(self.config, self.corpus, self.log, kill_at)
        self.webhook = self.client.create_webhook(f"llmc-{os.getpid()}-{self.proc.pid}", f"{self.url}/webhooks/mlflow",
                                                  events=["model_version.created"], secret=SECRET)

    def stop(self) -> None:
        self.client.delete_webhook(self.webhook.webhook_id)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)

    def jobs(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.root / "state" / "queue").glob("*.json"))]


def _versions(client, name: str) -> list:
    return client.search_model_versions(f"name = '{name}'")


def _sha256_tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_mlflow_webhook_builds_and_registers_the_variant_once(mlflow_uri, corpus, source_model, tmp_path) -> None:
    hook = Hook(tmp_path, mlflow_uri, corpus, "tiny-a*")
    try:
        version = register_source_version(mlflow_uri, "tiny-a", source_model, tags={"team": "x"})
        jobs = wait_jobs(hook.url, 1, 600, hook.proc)
        assert [j["state"] for j in jobs] == ["done"], (jobs, hook.log.read_text()[-3000:])
        name = f"tiny-a.{VARIANT}"
        [mv] = _versions(hook.client, name)
        tags = mv.tags
        assert tags["llmc.source.uri"] == f"models:/tiny-a/{version}" and tags["llmc.source.model"] == "tiny-a"
        assert tags["llmc.gates"] == "passed"
        gate_tags = {k: v for k, v in tags.items() if k.startswith("llmc.gate.")}
        assert set(gate_tags) == {"llmc.gate.max_ppl_increase_pct.torch", "llmc.gate.max_mean_kld.torch",
                                  "llmc.gate.min_top1_agreement_pct.torch"}
        assert all(v.startswith("pass: ") for v in gate_tags.values())
        run = hook.client.get_run(mv.run_id)
        assert {"torch.ppl", "torch.ppl_change_pct", "torch.ppl_change_ci_high_pct", "torch.kld",
                "torch.top1_agreement"} <= set(run.data.metrics)
        assert run.info.status == "FINISHED"
        # the registered files are the local registry entry's, model card included
        got = Path(hook.client.download_artifacts(mv.run_id, "artifact", str(tmp_path / "got")))
        [entry] = [e for e in (tmp_path / "state" / "registry" / "tiny-w8").iterdir() if not e.name.startswith(".")]
        assert _sha256_tree(got) == _sha256_tree(entry / "artifacts" / "vllm-sm90-tp1")
        card = (got / "README.md").read_text()
        meta = yaml.safe_load(card.split("---\n")[1])
        assert meta["base_model"] == "tiny-a" and meta["base_model_relation"] == "quantized"
        assert meta["license"] == "apache-2.0"
        assert run.data.metrics["torch.ppl"] == pytest.approx(meta["model-index"][0]["results"][0]["metrics"][0]["value"],
                                                              abs=1e-3)
        assert mv.description.startswith("---\nbase_model: tiny-a")

        # the same delivery again (MLflow's retry), and the same event delivered anew: no job, no build, no version
        for delivery_id in ("retry-1", "retry-1", "another"):
            body, headers = signed_delivery(version_created("tiny-a", version), delivery_id=delivery_id)
            status, answer = post(f"{hook.url}/webhooks/mlflow", body, headers)
            assert status == 202 and answer["jobs"][0]["new"] is False and answer["jobs"][0]["state"] == "done"
        # a bad signature: 401, nothing queued
        body, headers = signed_delivery(version_created("tiny-a", "99"), secret="not the secret")
        assert post(f"{hook.url}/webhooks/mlflow", body, headers)[0] == 401
        assert len(hook.jobs()) == 1 and hook.jobs()[0]["attempts"] == 1
        assert len(_versions(hook.client, name)) == 1
        assert "refused MLflow delivery" in hook.log.read_text() and SECRET not in hook.log.read_text()
    finally:
        hook.stop()


def _clean_build_hashes(job: dict, state: Path, corpus: Path, root: Path, monkeypatch) -> dict[str, str]:
    """The artifact files a clean build of the job's recipe publishes (fresh cache, same source folder)."""
    from llmc.build import build
    from llmc.hook.jobs import _model_folder
    from llmc.recipe.schema import Recipe
    from llmc.storage.store import Store

    use_corpus_file(corpus, monkeypatch.setattr)
    recipe = Recipe.model_validate(job["recipe"])
    folder = _model_folder(state / "sources" / "mlflow" / job["source"]["name"] / job["source"]["version"])
    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"source": str(folder)}),
                                       "publish": recipe.publish.model_copy(update={"registry": str(root / "registry")})})
    result = build(recipe, Store(root / "cache"))
    assert result.passed
    return published_artifact_hashes(root / "registry")


@pytest.mark.parametrize("kill_at", ["export:written", "mlflow:uploaded"])
def test_sigkill_then_restart_registers_exactly_once_with_a_clean_builds_bytes(kill_at: str, mlflow_uri, corpus,
                                                                              source_model, tmp_path, monkeypatch):
    model = f"tiny-{kill_at.split(':')[0]}"
    hook = Hook(tmp_path / "hook", mlflow_uri, corpus, f"{model}*", kill_at=kill_at)
    try:
        register_source_version(mlflow_uri, model, source_model)
        assert hook.proc.wait(timeout=600) == -signal.SIGKILL, hook.log.read_text()[-3000:]
        [job] = hook.jobs()
        assert job["state"] == "running"  # as the killed worker left it
        assert _versions(hook.client, f"{model}.{VARIANT}") == []
        hook.start()  # no kill this time: it resumes the job from the stage cache
        jobs = wait_jobs(hook.url, 1, 600, hook.proc)
        assert [j["state"] for j in jobs] == ["done"], hook.log.read_text()[-3000:]
        assert "was running when its worker died" in hook.log.read_text()
        [job] = hook.jobs()
        assert job["attempts"] == 2
        [mv] = _versions(hook.client, f"{model}.{VARIANT}")
        key = mv.tags["llmc.idempotency_key"]
        runs = hook.client.search_runs([hook.client.get_experiment_by_name("llmc-hook").experiment_id],
                                       filter_string=f"tags.`llmc.idempotency_key` = '{key}'")
        assert [r.info.run_id for r in runs] == [mv.run_id]  # one upload (reused after a kill between upload and
        #                                                      registration), no half-registered leftover
        clean = _clean_build_hashes(job, tmp_path / "hook" / "state", corpus, tmp_path / "clean", monkeypatch)
        assert published_artifact_hashes(tmp_path / "hook" / "state" / "registry") == clean
        got = Path(hook.client.download_artifacts(mv.run_id, "artifact", str(tmp_path / "got")))
        assert {f"tiny-w8/{job['build_id']}/artifacts/vllm-sm90-tp1/{k}": v
                for k, v in _sha256_tree(got).items()} == clean
    finally:
        hook.stop()


def test_hook_run_and_status_without_a_webhook(mlflow_uri, corpus, source_model, tmp_path, monkeypatch) -> None:
    """`llmc hook run` builds and registers in its own process; again, it is a no-op; a recipe whose gate fails
    registers nothing and exits 5; `llmc hook status` lists all three jobs."""
    from click.testing import CliRunner
    from mlflow import MlflowClient

    from llmc.cli import main

    use_corpus_file(corpus, monkeypatch.setattr)
    monkeypatch.chdir(tmp_path)
    recipe = tiny_recipe(tmp_path / "recipe.yaml", tmp_path / "unused")
    failing = tiny_recipe(tmp_path / "failing.yaml", tmp_path / "unused", name="tiny-strict")
    data = yaml.safe_load(failing.read_text())
    data["gates"]["max_mean_kld"] = 1e-9  # no quantization passes this
    failing.write_text(yaml.safe_dump(data))
    config = hook_config(tmp_path / "hook.yaml", mlflow_uri, recipe, models="tiny-cli")
    version = register_source_version(mlflow_uri, "tiny-cli", source_model)
    uri = f"models:/tiny-cli/{version}"
    client = MlflowClient(mlflow_uri)
    runner = CliRunner()

    first = runner.invoke(main, ["hook", "run", uri, "--config", str(config)])
    assert first.exit_code == 0, first.output
    assert f"tiny-cli.{VARIANT} v1" in first.output and " done " in first.output
    again = runner.invoke(main, ["hook", "run", uri, "--config", str(config)])
    assert again.exit_code == 0 and f"tiny-cli.{VARIANT} v1" in again.output
    assert len(_versions(client, f"tiny-cli.{VARIANT}")) == 1

    strict = runner.invoke(main, ["hook", "run", uri, "--config", str(config), "--recipe", str(failing)])
    assert strict.exit_code == 5, strict.output
    assert "gate failed (nothing registered): max_mean_kld" in strict.output
    assert _versions(client, "tiny-cli.tiny-strict.vllm-sm90-tp1") == []

    status = runner.invoke(main, ["hook", "status", "--config", str(config), "--json"])
    listed = json.loads(status.output)
    assert listed["worker"] is False
    assert sorted(j["state"] for j in listed["jobs"]) == ["done", "failed"]
    assert [j["attempts"] for j in listed["jobs"] if j["state"] == "done"] == [1]  # the second run built nothing
