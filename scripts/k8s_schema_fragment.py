"""Cut the part of the Kubernetes OpenAPI (Swagger 2.0) schema that the hook's Job touches out of the official
client's copy, for tests/unit/test_hook_k8s_schema.py: batch/v1 Job and JobStatus, core/v1 PodList, meta/v1 Status
(the API server's error body), and every definition they reach. Descriptions are dropped (size); nothing else is
changed.

    git -C kubernetes-client-python show v36.0.3:kubernetes/swagger.json.unprocessed > swagger.json
    python scripts/k8s_schema_fragment.py swagger.json v36.0.3 > tests/unit/data/k8s_batch_v1_job.schema.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

ROOTS = ("io.k8s.api.batch.v1.Job", "io.k8s.api.batch.v1.JobStatus", "io.k8s.api.core.v1.PodList",
         "io.k8s.apimachinery.pkg.apis.meta.v1.Status")


def refs(node: object) -> Iterator[str]:
    """The definition names a schema node points at ($ref: #/definitions/<name>)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value.rsplit("/", 1)[-1]
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def without_descriptions(node: object) -> object:
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def fragment(swagger: dict, roots: tuple[str, ...] = ROOTS) -> dict[str, object]:
    """The root definitions and their closure over $ref."""
    definitions, kept, todo = swagger["definitions"], {}, list(roots)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = without_descriptions(definitions[name])
            todo.extend(refs(definitions[name]))
    return dict(sorted(kept.items()))


def main(argv: list[str]) -> None:
    path, version = argv
    with open(path) as f:
        swagger = json.load(f)
    out = {"source": f"kubernetes-client/python {version}: kubernetes/swagger.json.unprocessed",
           "definitions": fragment(swagger)}
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
