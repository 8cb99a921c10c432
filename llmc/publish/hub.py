"""Publishing a registry entry to the Hugging Face Hub (`publish: {hub: org/name}`), one branch per build.

`upload_plan` is pure: from a verified registry entry it lists what goes where. One artifact: its files (model card
README.md included) at the repository root, loadable as it is; several: each under `<target label>/`. The entry's
manifest and reports go under `llmc/`. The branch is `llmc-<build id>`; a build whose branch exists is not pushed
again. `push` performs a plan through `huggingface_hub` (create the repository if needed, the branch, one commit);
any failure to reach or write the Hub is a RegistryError naming the repository, never the token (HF_TOKEN, read by
huggingface_hub itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmc.errors import InputError, RegistryError
from llmc.telemetry.progress import log
from llmc.storage.paths import confined
from llmc.publish.local import read_manifest, verify_entry

REPORT_FILES = ("manifest.json", "manifest.sig", "report.md", "report.json", "junit.xml")


@dataclass(frozen=True)
class HubUpload:
    repo_id: str
    revision: str  # the branch this build's commit lands on
    files: tuple[tuple[str, Path], ...]  # (path in the repository, local file)
    commit_message: str


def upload_plan(entry: Path, repo_id: str) -> HubUpload:
    """What pushing registry entry `entry` to `repo_id` uploads; refused (InputError) unless the entry is intact."""
    entry = Path(entry)
    problems = verify_entry(entry)
    if problems:
        raise InputError(f"{entry} does not match its manifest ({'; '.join(problems[:4])}); not pushing it",
                         fix="publish the recipe again (llmc publish RECIPE repairs the entry)")
    manifest = read_manifest(entry)
    labels = sorted(manifest["report"]["targets"], key=len, reverse=True)  # "variant/target" before "variant"
    files: list[tuple[str, Path]] = []
    for rel in sorted(manifest["files"]):
        local = confined(entry, rel, what="manifest path")
        if rel.startswith("artifacts/"):
            inner = rel[len("artifacts/"):]
            label = next(lb for lb in labels if inner.startswith(lb + "/"))
            files.append((inner[len(label) + 1:] if len(labels) == 1 else inner, local))
        elif rel in REPORT_FILES:
            files.append((f"llmc/{rel}", local))
    for extra in ("manifest.json", "manifest.sig"):  # not in the manifest's own list
        if (entry / extra).is_file():
            files.append((f"llmc/{extra}", entry / extra))
    build_id = manifest["build_id"]
    return HubUpload(repo_id=repo_id, revision=f"llmc-{build_id}", files=tuple(files),
                     commit_message=f"llmc {manifest.get('llmc_version')}: {manifest['recipe']['name']} build {build_id}")


def push(plan: HubUpload, endpoint: str | None = None) -> str:
    """Perform `plan` (on `endpoint`, default the Hub or $HF_ENDPOINT); returns the branch's URL. An existing branch
    of this build is left as it is."""
    from huggingface_hub import CommitOperationAdd, HfApi  # lazy: huggingface_hub's HfApi (~1 s), only when pushing

    api = HfApi(endpoint=endpoint)
    try:
        api.create_repo(plan.repo_id, repo_type="model", exist_ok=True)
        refs = api.list_repo_refs(plan.repo_id)
        if any(b.name == plan.revision for b in refs.branches):
            log(f"hub: {plan.repo_id}@{plan.revision} already exists; not pushing again")
        else:
            api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True)
            ops = [CommitOperationAdd(path_in_repo=dst, path_or_fileobj=str(src)) for dst, src in plan.files]
            api.create_commit(plan.repo_id, operations=ops, commit_message=plan.commit_message,
                              revision=plan.revision)
    except Exception as e:  # noqa: BLE001 - offline, DNS, refused, auth, rate limits: all "the Hub did not take it"
        status = getattr(getattr(e, "response", None), "status_code", None)
        raise RegistryError(f"could not publish to the Hugging Face Hub repository {plan.repo_id} "
                            f"({type(e).__name__}{f', HTTP {status}' if status else ''}): the Hub is unreachable "
                            "from here or refused the upload",
                            fix="check network access to the Hub (HF_ENDPOINT, HF_HUB_OFFLINE) and that HF_TOKEN may "
                                "write the repository; the local registry entry is complete, rerun to push it") from None
    return f"{api.endpoint}/{plan.repo_id}/tree/{plan.revision}"


def publish_to_hub(entry: Path, repo_id: str) -> str:
    return push(upload_plan(entry, repo_id))
