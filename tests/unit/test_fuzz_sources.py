"""Property-based fuzzing of data sources and model folders (issue 33 part 4, issue 35's source checks).

Data sources: jsonl / json / csv / parquet / text files generated and corrupted as data (rows of any JSON value,
nesting up to 100,000 deep, long rows, missing and mistyped columns, chat turns) and as bytes (encodings UTF-8,
UTF-8 with BOM, UTF-16, Latin-1, random bytes, truncation, flipped bytes, NULs). Property: the calibration
tokens are made, or an InputError (exit 7) says why, with no raw control character in its message, in bounded
time; no other exception, no crash.

Model folders: the tiny model with its tokenizer files, config and generation config corrupted (garbage,
truncation, deep nesting, wrong shapes, special tokens and added tokens at any id, sizes that disagree, a
500 MB sparse file). Property: `make_plan` either refuses with a documented exit code (never 70) or plans, and a
folder that plans loads its tokenizer (`load_tokenizer`) with every id inside the embedding.

The default run is a fixed-seed budget (derandomized); `pytest -m fuzz_long tests/unit/test_fuzz_sources.py` runs
LLMC_FUZZ_DATA (1,000) data sources and LLMC_FUZZ_FOLDERS (1,000) model folders (docs/model-sources.md).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import os

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="pip install -e '.[dev]' installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import llmc.data.loaders as loaders  # noqa: E402
import llmc.data.tokens as tokens_module  # noqa: E402
from llmc.errors import INTERNAL_ERROR_EXIT_CODE, InputError, LlmcError  # noqa: E402
from tests.conftest import make_tokenizer  # noqa: E402
from tests.unit.fuzz_limits import ClassRates, measured_case  # noqa: E402
from tests.unit.timeouts import alarm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_build import recipe_text  # noqa: E402

PER_CASE_S = 60  # generous: the machine is shared; a hang is what this catches
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u202a-\u202e\u2066-\u2069]")
DEFAULT = dict(derandomize=True, deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large])
LONG = dict(DEFAULT, derandomize=False)


# --------------------------------------------------------------------------- data sources

TEXT = st.text(st.characters(codec="utf-8"), max_size=60)
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=10)
TURNS = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": TEXT}),
                 min_size=1, max_size=3)
ROW = st.one_of(st.fixed_dictionaries({"text": TEXT}), st.fixed_dictionaries({"text": JSONISH}),
                st.fixed_dictionaries({"messages": TURNS}), JSONISH)
ENCODINGS = st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "latin-1"])
SMALL_ROW_CAP = 4096  # MAX_ROW_BYTES in these runs, so the over-long-row path costs kilobytes


def _nested(depth: int, kind: str) -> str:
    return ('{"a": ' * depth + "1" + "}" * depth) if kind == "obj" else ("[" * depth + "]" * depth)


@st.composite
def data_files(draw) -> tuple[str, dict, bytes]:
    """(kind, source fields other than kind/path, file bytes)."""
    kind = draw(st.sampled_from(["jsonl", "json", "csv", "parquet", "text"]))
    rows = draw(st.lists(ROW, max_size=12))
    mangle = draw(st.sampled_from(["none", "none", "truncate", "flip", "random", "deep", "long_row", "nul"]))
    encoding = draw(ENCODINGS)
    seed = draw(st.integers(0, 2**32 - 1))
    column = draw(st.sampled_from([{"field": "text"}, {"messages": "messages"}, {"field": "missing"}, {}]))
    rng = random.Random(seed)
    if kind == "text":
        body = "\n\n".join(r["text"] if isinstance(r, dict) and isinstance(r.get("text"), str) else json.dumps(r)
                           for r in rows).encode(encoding, errors="replace")
        column = {}
    elif kind == "parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        if draw(st.booleans()):  # a well-formed text column, so that parquet also reaches the tokenizer
            sample = [{"text": t * 8} for t in draw(st.lists(TEXT, min_size=1, max_size=12))]
        else:
            sample = [r for r in rows if isinstance(r, dict)] or [{"text": "x"}]
        with contextlib.suppress(pa.ArrowException, TypeError, ValueError, OverflowError):
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(sample), buf)
            body = buf.getvalue()
        if "body" not in locals():
            body = b"PAR1" + rng.randbytes(64) + b"PAR1"
    else:
        lines = [json.dumps(r, ensure_ascii=False) for r in rows]
        if kind == "jsonl":
            body = "\n".join(lines)
        elif kind == "json":
            body = "[" + ", ".join(lines) + "]"
        else:
            body = "text,other\n" + "".join(
                '"' + (r.get("text") if isinstance(r, dict) and isinstance(r.get("text"), str) else
                       json.dumps(r)).replace('"', '""') + f'",{i}\n' for i, r in enumerate(rows))
        body = body.encode(encoding, errors="replace")
    if mangle == "truncate" and body:
        body = body[: rng.randrange(len(body))]
    elif mangle == "flip" and body:
        b = bytearray(body)
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        body = bytes(b)
    elif mangle == "random":
        body = rng.randbytes(rng.randrange(1, 2000))
    elif mangle == "deep":
        depth = rng.choice([100, 1000, 5000, 100_000])
        row = '{"text": ' + _nested(depth, rng.choice(["obj", "arr"])) + "}"
        body = body + (b"\n" if body else b"") + row.encode() + b"\n"
    elif mangle == "long_row":
        body = body + b'\n{"text": "' + b"y" * (SMALL_ROW_CAP + rng.randrange(10)) + b'"}\n'
    elif mangle == "nul":
        body = body.replace(b",", b"\x00", rng.randrange(1, 4))
    return kind, column, body


def _check_data_source(tmp: Path, case: tuple[str, dict, bytes], packing: str) -> str:
    from pydantic import TypeAdapter, ValidationError

    from llmc.data.sources import DataSource

    kind, column, body = case
    path = tmp / f"data.{kind}"
    path.write_bytes(body)
    start = time.monotonic()
    with measured_case("data sources") as record:
        record["kind"] = kind
        try:
            source = TypeAdapter(DataSource).validate_python({"kind": kind, "path": str(path), **column})
        except ValidationError:  # e.g. a jsonl source without a column: the recipe's schema refuses it (exit 2)
            record["outcome"] = "exit 2"
            with contextlib.suppress(Exception):
                hypothesis.event(f"{kind}: recipe error")
            return "recipe error"
        try:
            with alarm(PER_CASE_S, "the case"):
                ts = tokens_module.make_tokens(source, TOKENIZER, "calibration", packing=packing, count=2,
                                               seq_len=16, seed=0)
            outcome = "tokens"
            assert ts.input_ids.shape == (2, 16)
        except InputError as e:
            assert not CONTROL.search(str(e)), f"raw control characters in the error: {str(e)[:300]!r}"
            assert len(str(e)) < 4000
            outcome = "exit 7"
        record["outcome"] = outcome
    assert time.monotonic() - start < PER_CASE_S
    with contextlib.suppress(Exception):
        hypothesis.event(f"{kind}: {outcome}")
    return outcome


TOKENIZER = None


@pytest.fixture(scope="module")
def small_limits():
    """A chat template on the test tokenizer; a 4 KiB row cap and a 2,000-character read budget."""
    global TOKENIZER
    TOKENIZER = make_tokenizer()
    TOKENIZER.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    mp = pytest.MonkeyPatch()
    mp.setattr(loaders, "MAX_ROW_BYTES", SMALL_ROW_CAP)
    mp.setattr(tokens_module, "MIN_READ_CHARS", 2000)
    yield
    mp.undo()


@settings(max_examples=150, **DEFAULT)
@given(case=data_files(), packing=st.sampled_from(["windows", "samples"]))
def test_data_sources_make_tokens_or_exit_7(small_limits, case, packing) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _check_data_source(Path(tmp), case, packing)


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_DATA", 1000)), **LONG)
@given(case=data_files(), packing=st.sampled_from(["windows", "samples"]))
def test_data_sources_make_tokens_or_exit_7_long(small_limits, case, packing) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _check_data_source(Path(tmp), case, packing)


# --------------------------------------------------------------------------- model folders

FOLDER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "config.json", "added_tokens.json", "chat_template.jinja"]


# the newer families' own config.json fields (experts, routing, latent attention, linear attention, layer layouts)
MOE_CONFIG_KEYS = ["n_routed_experts", "num_local_experts", "num_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts",
                   "first_k_dense_replace", "interleave_moe_layer_step", "q_lora_rank", "kv_lora_rank",
                   "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "layer_types",
                   "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "sliding_window",
                   "attention_chunk_size", "intermediate_size_mlp", "swiglu_limit", "routed_scaling_factor",
                   "norm_topk_prob", "head_dim", "num_hidden_layers", "rope_parameters", "rope_scaling"]
MOE_CONFIG_VALUES = [0, 1, 2, 3, 4, 5, 8, 64, 10**6, -1, None, 0.5, "2", True, [], ["full_attention"],
                     ["linear_attention"] * 3, {"rope_type": "yarn"}, {"rope_type": "nope", "factor": -1}]


@st.composite
def folder_edits(draw, families: tuple[str, ...] = ("llama",)):
    """A function corrupting one file of a copy of the tiny model of one of `families` (or shifting its ids), with
    its name (`apply.family`: which model to copy)."""
    family = draw(st.sampled_from(families))
    name = draw(st.sampled_from(FOLDER_FILES))
    edit = draw(st.sampled_from(["garbage", "truncate", "deep", "value", "delete", "sparse", "special_id",
                                 "added_id", "config_size", "fine"] + (["moe_config"] * 3 if family != "llama"
                                                                       else [])))
    seed = draw(st.integers(0, 2**32 - 1))
    value = draw(JSONISH)

    def apply(folder: Path) -> None:
        rng = random.Random(seed)
        path = folder / name
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        if edit == "garbage":
            path.write_bytes(rng.randbytes(rng.randrange(1, 3000)))
        elif edit == "truncate" and path.exists():
            data = path.read_bytes()
            path.write_bytes(data[: rng.randrange(max(len(data), 1))])
        elif edit == "deep":
            path.write_text(_nested(rng.choice([50, 2000, 100_000]), rng.choice(["obj", "arr"])))
        elif edit == "value" and path.exists() and path.suffix == ".json":
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data:
                key = rng.choice(sorted(data))
                data[key] = value
            path.write_text(json.dumps(data, default=str))
        elif edit == "delete" and path.exists():
            path.unlink()
        elif edit == "sparse":
            with open(path, "wb") as f:
                f.truncate(500 << 20)
        elif edit in ("special_id", "added_id"):
            tj = json.loads((folder / "tokenizer.json").read_text())
            token_id = rng.choice([vocab - 1, vocab, vocab + 1, rng.randrange(2 * vocab), 10**6])
            content = f"<|x{rng.randrange(100)}|>"
            tj["added_tokens"].append({"id": token_id, "content": content, "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": True})
            (folder / "tokenizer.json").write_text(json.dumps(tj))
            if edit == "special_id":
                tc = json.loads((folder / "tokenizer_config.json").read_text())
                tc[rng.choice(["bos_token", "eos_token", "pad_token", "unk_token"])] = content
                (folder / "tokenizer_config.json").write_text(json.dumps(tc))
        elif edit == "config_size":
            config = json.loads((folder / "config.json").read_text())
            key = rng.choice(["vocab_size", "head_dim", "num_key_value_heads", "max_position_embeddings",
                              "bos_token_id", "eos_token_id", "model_type", "pad_token_id"])
            config[key] = rng.choice([vocab - 1, vocab + 1, 3, 16, 24, 48, 10**6, "../x", "qwen2", [1, vocab]])
            (folder / "config.json").write_text(json.dumps(config))
        elif edit == "moe_config":
            config = json.loads((folder / "config.json").read_text())
            for key in rng.sample(MOE_CONFIG_KEYS, rng.randrange(1, 3)):
                if rng.random() < 0.2:
                    config.pop(key, None)
                else:
                    config[key] = rng.choice(MOE_CONFIG_VALUES)
            (folder / "config.json").write_text(json.dumps(config))

    apply.__name__ = f"{edit}:{name}"
    apply.family = family
    return apply


def _embedding_rows(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_slice("model.embed_tokens.weight").get_shape()[0]


def _check_folder(models: dict[str, Path], apply, rates: ClassRates) -> str:
    from llmc.model.tokenizer_files import load_tokenizer
    from llmc.planning import probes
    from llmc.planning.plan import make_plan
    from llmc.recipe.load import parse_recipe

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(models[apply.family], Path(tmp) / "m"))
        apply(folder)
        cache = Path(tmp) / "cache"
        cache.mkdir()
        rates.lend(cache)
        recipe = parse_recipe(recipe_text(folder, Path(tmp) / "reg", **{"eval.seq_len": 64},
                                          **FOLDER_RECIPE.get(apply.family, {})))
        start = time.monotonic()
        with measured_case("model folders") as record:
            record["family"] = apply.family
            try:
                with alarm(PER_CASE_S, "the case"):
                    # as `llmc plan` does (plan_recipe): make_plan alone keeps its rates in the process, and every
                    # case after the first would read the first one's
                    probes.use_cache(cache)
                    make_plan(recipe, folder, cache, refuse=False)
                    tok = load_tokenizer(folder)  # what the build does next
                ids = [len(tok) - 1, *tok.all_special_ids]
                rows = _embedding_rows(folder)
                assert max(ids) < rows, f"{apply.__name__}: planned cleanly with token id {max(ids)} >= {rows} rows"
                outcome = "planned"
            except LlmcError as e:
                assert e.exit_code != INTERNAL_ERROR_EXIT_CODE, f"{apply.__name__}: exit 70: {e}"
                assert not CONTROL.search(str(e)), f"raw control characters in the error: {str(e)[:300]!r}"
                outcome = f"exit {e.exit_code}"
            record["outcome"] = outcome
            record["probed"], record["read"] = ClassRates.used(cache) or (0, 0)
        rates.keep(cache)
        assert time.monotonic() - start < PER_CASE_S
    with contextlib.suppress(Exception):
        hypothesis.event(f"{apply.__name__.split(':')[0]}: {outcome}")
    return outcome


# what a family's folder is planned with beside recipe_text's W8A8-FP8: DeepSeek's latent attention caches no KV a
# KV scheme could quantize (exit 3 otherwise). gpt-oss stays exit 3 after its folder is read: vLLM, the one runtime
# llmc targets for MoE, does not load a compressed-tensors gpt-oss (llmc/runtimes/vllm.py)
FOLDER_RECIPE: dict[str, dict] = {"deepseek_v3": {"quantization.kv_cache": None}}
NEW_FAMILIES = ("deepseek_v3", "gpt_oss", "qwen3_next", "llama4_text", "glm4_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def family_models(tiny_model_session: Path, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama and a tiny model of each newer MoE family (0.3-0.5 s each to make)."""
    from tests.unit.families import make_tiny

    base = tmp_path_factory.mktemp("families")
    return {"llama": tiny_model_session, **{f: make_tiny(f, base / f) for f in NEW_FAMILIES}}


@pytest.fixture
def class_rates(tmp_path: Path) -> ClassRates:
    """The test function's rate cache: empty at its first case (hypothesis runs every case in one fixture scope)."""
    return ClassRates(tmp_path)


@settings(max_examples=60, **DEFAULT)
@given(apply=folder_edits(("llama", "llama", "llama", *NEW_FAMILIES)))
def test_model_folders_plan_or_refuse(family_models: dict[str, Path], class_rates: ClassRates, apply) -> None:
    _check_folder(family_models, apply, class_rates)


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_FOLDERS", 1000)), **LONG)
@given(apply=folder_edits(("llama", *NEW_FAMILIES)))
def test_model_folders_plan_or_refuse_long(family_models: dict[str, Path], class_rates: ClassRates,
                                           apply) -> None:
    _check_folder(family_models, apply, class_rates)
