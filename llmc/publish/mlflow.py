"""Registering a published build's variants in MLflow's model registry, once, and only when fully uploaded.

Naming: each artifact of a build becomes a version of the registered model `<source model>.<recipe>.<target label>`
('/' in a variant label becomes '.'), e.g. `smollm2.smollm2-fp8.vllm-sm90-tp1`. Its files live in an MLflow run of
the experiment `llmc-hook`: `artifact/` (the artifact's files and its model card README.md) and `build/` (the
registry entry's manifest.json and reports). The run carries the metrics (per engine: perplexity, its change with
its 95% interval, KL divergence, top-1 agreement, and tokens/s where a serving runtime measured them); the model
version carries the gate verdicts and the lineage as tags (`llmc.source.uri` = the source model version) and the
model card as its description.

Crash safety: (1) a version is created only after every uploaded file was read back and its sha256 matched the
manifest, and the run marked FINISHED; (2) every run and version carries `llmc.idempotency_key` (source model version
+ content hash, resolved recipe, llmc version): a version with the key is never registered again, a FINISHED run
with the key is registered without uploading again, and an unfinished one (a process killed mid-upload) is deleted
before the next attempt. A failed gate registers nothing: the caller registers only a build that passed.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmc import __version__

from llmc.telemetry import events
from llmc.errors import RegistryError
from llmc.telemetry.progress import log
from llmc.storage.store import sha256_file
from llmc.publish.model_card import CARD_FILE
from llmc.publish.model_card import variant_metrics as card_rows
from llmc.publish.local import read_manifest

if TYPE_CHECKING:
    from llmc.result import BuildResult

EXPERIMENT = "llmc-hook"
KEY_TAG = "llmc.idempotency_key"
VARIANT_TAG = "llmc.variant"
ARTIFACT_PATH = "artifact"
BUILD_PATH = "build"
BUILD_FILES = ("manifest.json", "manifest.sig", "report.md", "report.json", "junit.xml")


@dataclass(frozen=True)
class Registration:
    name: str
    version: str
    run_id: str
    new: bool  # False: the version with this key was already there


def idempotency_key(source_uri: str, source_sha256: str, recipe: dict, llmc_version: str = __version__) -> str:
    """What makes two registrations the same: the source version and its content, the resolved recipe (its model
    source and publish sections left out: they name local paths), the llmc version."""
    blob = json.dumps({"source": source_uri, "sha256": source_sha256, "recipe": recipe, "llmc": llmc_version},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def variant_model_name(source_name: str, recipe_name: str, label: str) -> str:
    return f"{source_name}.{recipe_name}.{label.replace('/', '.')}"


def client(tracking_uri: str):
    """An MlflowClient for `tracking_uri`; RegistryError when MLflow is not installed."""
    try:
        from mlflow import MlflowClient  # lazy: optional mlflow (llmc[registry], ~4 s); absent -> RegistryError
    except ImportError:
        raise RegistryError("MLflow is not installed", fix="pip install 'llmc[registry]'") from None
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _call(what: str, fn, *args, **kwargs):
    """An MLflow client call; failures to reach the server or refusals become RegistryError (no secret is in them:
    the client never sends the webhook secret)."""
    from mlflow.exceptions import MlflowException  # lazy: optional mlflow (llmc[registry], ~4 s)

    try:
        return fn(*args, **kwargs)
    except MlflowException as e:
        raise RegistryError(f"MLflow refused to {what}: {str(e.message)[:300]}",
                            fix="check the tracking URI, the server's log and its permissions") from None
    except OSError as e:  # requests' connection errors are OSErrors
        raise RegistryError(f"MLflow unreachable while trying to {what}: {type(e).__name__}: {str(e)[:200]}",
                            fix="start the MLflow server or correct the tracking URI") from None


def variant_metrics(result: "BuildResult", label: str) -> dict[str, float]:
    """The run's metrics for artifact `label`: '<engine>.<metric>' ('<engine>.<corpus>.<metric>' when eval.corpus
    names several corpora)."""
    out: dict[str, float] = {}
    for r in card_rows(result, label):
        e = r["engine"] + (f".{r['corpus']}" if r["corpus"] is not None else "")
        out[f"{e}.ppl"], out[f"{e}.ppl_base"] = r["ppl"], r["ppl_base"]
        if r["ppl_change"]:
            ch = r["ppl_change"]
            out |= {f"{e}.ppl_change_pct": ch["delta_pct"], f"{e}.ppl_change_ci_low_pct": ch["ci_low_pct"],
                    f"{e}.ppl_change_ci_high_pct": ch["ci_high_pct"]}
        for name, d in (("kld", r["kld"]), ("top1_agreement", r["top1"])):
            if d:
                out |= {f"{e}.{name}": d["mean"], f"{e}.{name}_ci_low": d["ci_low"], f"{e}.{name}_ci_high": d["ci_high"]}
        for k, v in (r.get("tokens_per_s") or {}).items():
            out[f"{e}.{k}"] = v
    return {k: float(v) for k, v in out.items() if v is not None}


def variant_tags(result: "BuildResult", label: str, source: dict, key: str) -> dict[str, str]:
    """The model version's tags: identity, lineage and one tag per gate verdict on this artifact."""
    art = result.artifacts[label]
    tags = {KEY_TAG: key, VARIANT_TAG: label, "llmc.build_id": result.build_id, "llmc.version": __version__,
            "llmc.recipe": result.recipe.name, "llmc.scheme": art.scheme, "llmc.format": art.format,
            "llmc.runtime": str(art.target.get("runtime")), "llmc.source.uri": source["uri"],
            "llmc.source.model": source["name"], "llmc.source.version": str(source["version"]),
            "llmc.source.sha256": result.source.sha256, "llmc.gates": result.gates_status[0]}
    for v in result.verdicts:
        if v.target.label == label and v.target.corpus is None:
            tags[f"llmc.gate.{v.gate}" + (f".{v.target.engine}" if v.target.engine else "")] = (
                f"{'pass' if v.passed else 'FAIL'}: {v.measured} (threshold {v.threshold})")
    return tags


def _experiment_id(c) -> str:
    exp = _call("read the experiment", c.get_experiment_by_name, EXPERIMENT)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(EXPERIMENT)
    except Exception:  # noqa: BLE001 - another process created it meanwhile
        return _call("read the experiment", c.get_experiment_by_name, EXPERIMENT).experiment_id


def _existing_version(c, name: str, key: str):
    from mlflow.exceptions import MlflowException  # lazy: optional mlflow (llmc[registry], ~4 s)

    try:
        versions = c.search_model_versions(f"name = '{name}'")
    except MlflowException:
        return None
    return next((v for v in versions if (v.tags or {}).get(KEY_TAG) == key), None)


def _runs_with_key(c, experiment_id: str, key: str, label: str) -> list:
    return _call("search runs", c.search_runs, [experiment_id],
                 filter_string=f"tags.`{KEY_TAG}` = '{key}' and tags.`{VARIANT_TAG}` = '{label}'")


def _upload_and_verify(c, run_id: str, entry: Path, label: str, manifest_files: dict[str, str]) -> None:
    """Upload the artifact folder and the build files, then read every file back and compare its sha256 with the
    manifest's; RegistryError on any difference (the run stays unfinished and is deleted at the next attempt)."""
    art_dir = entry / "artifacts" / label
    _call("upload the artifact", c.log_artifacts, run_id, str(art_dir), ARTIFACT_PATH)
    for f in BUILD_FILES:
        if (entry / f).is_file():
            _call("upload the build files", c.log_artifact, run_id, str(entry / f), BUILD_PATH)
    expected = {f"{ARTIFACT_PATH}/{rel[len(f'artifacts/{label}/'):]}": digest for rel, digest in manifest_files.items()
                if rel.startswith(f"artifacts/{label}/")}
    expected[f"{BUILD_PATH}/manifest.json"] = sha256_file(entry / "manifest.json")
    with tempfile.TemporaryDirectory(prefix="llmc-verify-") as tmp:
        _call("read the upload back", c.download_artifacts, run_id, "", tmp)
        got = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in Path(tmp).rglob("*") if p.is_file()}
    problems = [f"missing {rel}" for rel in expected if rel not in got]
    problems += [f"modified {rel}" for rel in expected if rel in got and got[rel] != expected[rel]]
    if problems:
        raise RegistryError(f"the upload of {label} to run {run_id} does not match the manifest: "
                            f"{'; '.join(problems[:4])}", fix="rerun: the unfinished run is deleted and uploaded again")


def register_variant(c, result: "BuildResult", label: str, source: dict, key: str) -> Registration:
    """Register artifact `label` of the published `result` as a version of its registered model, at most once."""
    from mlflow.exceptions import MlflowException  # lazy: optional mlflow (llmc[registry], ~4 s)

    entry = Path(result.published)
    name = variant_model_name(source["name"], result.recipe.name, label)
    found = _existing_version(c, name, key)
    if found is not None:
        log(f"hook: {name} version {found.version} already registered for this build; not registering again")
        return Registration(name, str(found.version), found.run_id, new=False)
    try:
        c.create_registered_model(name, tags={"llmc.source.model": source["name"]},
                                  description=f"llmc variants ({result.recipe.name}, {label}) of {source['name']}")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise RegistryError(f"MLflow refused to create registered model {name}: {str(e.message)[:300]}",
                                fix="check the server's log and permissions") from None
    experiment_id = _experiment_id(c)
    run_id = None
    for run in _runs_with_key(c, experiment_id, key, label):
        if run.info.status == "FINISHED" and run_id is None:
            run_id = run.info.run_id  # uploaded and verified before a crash: register it as it is
        else:
            log(f"hook: deleting run {run.info.run_id} of an interrupted upload ({run.info.status})")
            _call("delete an interrupted run", c.delete_run, run.info.run_id)
    if run_id is None:
        tags = {KEY_TAG: key, VARIANT_TAG: label, "llmc.build_id": result.build_id, "llmc.source.uri": source["uri"]}
        run = _call("create a run", c.create_run, experiment_id, tags=tags, run_name=name[:200])
        run_id = run.info.run_id
        from mlflow.entities import Metric, Param  # lazy: optional mlflow (llmc[registry], ~4 s)

        metrics = [Metric(k, v, 0, 0) for k, v in sorted(variant_metrics(result, label).items())]
        params = [Param("recipe", result.recipe.name), Param("variant", label), Param("build_id", result.build_id)]
        _call("log metrics", c.log_batch, run_id, metrics=metrics, params=params)
        _upload_and_verify(c, run_id, entry, label, read_manifest(entry)["files"])
        _call("finish the run", c.set_terminated, run_id, "FINISHED")
        events.emit(f"mlflow:uploaded:{label}")
    card = (entry / "artifacts" / label / CARD_FILE).read_text(encoding="utf-8")
    version = _call("create the model version", c.create_model_version, name, f"runs:/{run_id}/{ARTIFACT_PATH}",
                    run_id, tags=variant_tags(result, label, source, key), description=card[:5000])
    events.emit(f"mlflow:registered:{label}")
    log(f"hook: registered {name} version {version.version}")
    return Registration(name, str(version.version), run_id, new=True)


def register_build(c, result: "BuildResult", source: dict, key: str) -> list[Registration]:
    """Every artifact of a published build that passed its gates; nothing for a build that did not."""
    if not result.passed or result.published is None:
        return []
    return [register_variant(c, result, label, source, key) for label in result.artifacts]
