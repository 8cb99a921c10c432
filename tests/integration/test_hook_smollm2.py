"""End to end on the real SmolLM2-135M: a real MLflow server, the checkpoint registered as a new model version,
MLflow's webhook delivering to `llmc hook serve` (registered with `llmc hook webhook`), and the FP8 variants of
recipes/smollm2-fp8.yaml appearing in the registry with metrics, gate tags, lineage and model card. Triggered by the
webhook only: the test never calls a build. Slow (a real build: minutes on 2 cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mlflow")

from tests.unit.hook_helpers import (REPO, SECRET, hook_config, register_source_version, start_hook,  # noqa: E402
                                     start_mlflow, wait_jobs)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_smollm2_version_in_mlflow_gets_its_fp8_variants_registered_by_the_webhook(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from llmc.model.source import resolve_source
    from llmc.storage.store import Store

    server, uri = start_mlflow(tmp_path / "mlflow")
    hook = None
    try:
        folder = resolve_source("demo:smollm2-135m", Store(tmp_path / "cache"), "float32").folder
        config = hook_config(tmp_path / "hook.yaml", uri, REPO / "recipes" / "smollm2-fp8.yaml", models="smollm2")
        hook, url = start_hook(config, None, tmp_path / "hook.log")
        env = {**os.environ, "LLMC_HOOK_MLFLOW_SECRET": SECRET}
        made = subprocess.run([sys.executable, "-c", "from llmc.cli import main; main()", "hook", "webhook",
                               "--config", str(config), "--url", f"{url}/webhooks/mlflow"],
                              env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert made.returncode == 0 and "model_version.created" in made.stdout, made.stderr[-2000:]

        version = register_source_version(uri, "smollm2", folder)
        jobs = wait_jobs(url, 1, 3600, hook)
        assert [j["state"] for j in jobs] == ["done"], (tmp_path / "hook.log").read_text()[-4000:]

        client = MlflowClient(uri)
        for target in ("vllm-sm90-tp1", "vllm-sm89-tp1"):
            [mv] = client.search_model_versions(f"name = 'smollm2.smollm2-fp8.{target}'")
            assert mv.tags["llmc.source.uri"] == f"models:/smollm2/{version}"
            assert mv.tags["llmc.gates"] == "passed" and mv.tags["llmc.scheme"] == "W8A8-FP8"
            assert mv.tags["llmc.gate.max_ppl_increase_pct.torch"].startswith("pass: ")
            metrics = client.get_run(mv.run_id).data.metrics
            assert 20 < metrics["torch.ppl_base"] < 80 and 0.1 < metrics["torch.ppl_change_pct"] < 10
            assert metrics["torch.kld"] < 0.1 and metrics["torch.top1_agreement"] > 0.8
            card = Path(client.download_artifacts(mv.run_id, "artifact/README.md", str(tmp_path / target)))
            meta = yaml.safe_load(card.read_text().split("---\n")[1])
            assert meta["base_model"] == "smollm2" and meta["base_model_relation"] == "quantized"
            assert "vllm serve" in card.read_text()
        print(f"registered: {[j['registrations'] for j in jobs]}")
    finally:
        for proc in (hook, server):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
