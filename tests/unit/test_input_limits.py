"""One regression test per class of malformed input that used to crash, hang or run away (issue 23).

Each asserts the documented exit code / error class, a message naming the problem and the fix, and (where the
old failure was a hang or a big read) a time and memory bound."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.errors import InputError, RecipeError
from llmc.model.checkpoint import CheckpointReader, check_safetensors_header, read_model_config
from llmc.model.gguf_header import check_gguf_header
from llmc.model.source import resolve_source
from llmc.recipe.load import load_recipe, parse_recipe
from llmc.storage.store import Store

BASE = ("name: r\nmodel: {source: demo:smollm2-135m}\n"
        "quantization: {weights: {format: int8, strategy: channel}, ignore: [lm_head]}\n"
        "targets: [{runtime: vllm}]\n")


def laughs(levels: int) -> str:
    lines = ["l0: &l0 [a, a, a, a, a, a, a, a, a]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def recipe_error(text: str) -> str:
    with pytest.raises(RecipeError) as e:
        parse_recipe(text)
    assert e.value.exit_code == 2
    return str(e.value)


# --- YAML ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, needles", [
    (BASE.replace("name: r", "name: !!float 'x'"), ["line 1, column 7", "'x'", "!!float", "fix: remove the tag"]),
    (BASE + "calibration: {samples: !!int 'abc'}\n", ["line 5", "!!int"]),
    (BASE + "x: !!python/object:os.system 'ls'\n", ["line 5", "python/object"]),
    (BASE + "x: !foo 1\n", ["!foo"]),
    (BASE + "x: 2001-13-45\n", ["2001-13-45", "month must be in 1..12", "quote the value"]),
    (BASE + "x: {[1]: 2}\n", ["line 5", "unhashable key"]),
])
def test_values_yaml_cannot_build_are_errors_at_their_line(text: str, needles: list[str]) -> None:
    message = recipe_error(text)
    for n in needles:
        assert n in message, message


def test_billion_laughs_fails_fast() -> None:
    text = laughs(9) + BASE.replace("ignore: [lm_head]", "ignore: *l9")  # 9^10 strings when expanded
    start = time.monotonic()
    message = recipe_error(text)
    assert time.monotonic() - start < 2
    assert "expands to more than 20,000 values" in message and "alias" in message and "fix:" in message


@pytest.mark.parametrize("anchor", ["a: &a [*a]\n", "a: &a {b: *a}\n", "a: &a [[[[*a]]]]\n"])
def test_recursive_anchors_are_refused(anchor: str) -> None:
    message = recipe_error(anchor + BASE)
    assert "recursive anchor" in message and "line 1" in message


@pytest.mark.parametrize("nest", ["[" * 5000 + "]" * 5000, "{a: " * 3000 + "1" + "}" * 3000])
def test_deep_nesting_is_refused_without_recursion_error(nest: str) -> None:
    assert "nested more than 32 levels" in recipe_error(BASE + "x: " + nest + "\n")


def test_deep_nesting_through_aliases_is_refused() -> None:
    chain = "a0: &a0 " + "[" * 20 + "1" + "]" * 20 + "\n"
    chain += "".join(f"a{i}: &a{i} " + "[" * 20 + f"*a{i - 1}" + "]" * 20 + "\n" for i in range(1, 4))
    assert "with aliases expanded" in recipe_error(chain + BASE)


def test_million_key_mapping_is_refused_quickly(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(BASE + "x:\n" + "".join(f"  k{i}: 1\n" for i in range(1_000_000)))
    start = time.monotonic()
    with pytest.raises(RecipeError, match=r"bytes; at most 1,048,576 are read"):
        load_recipe(big)
    wide = BASE + "x: {" + ", ".join(f"k{i}: 1" for i in range(30_000)) + "}\n"  # under the size cap
    assert "more than 1,000 keys" in recipe_error(wide)
    assert time.monotonic() - start < 10


def test_duplicate_keys_and_second_documents_are_refused() -> None:
    assert "key 'name' appears twice" in recipe_error(BASE + "name: s\n")
    assert "more than one YAML document" in recipe_error(BASE + "---\n" + BASE)


# --- numbers ------------------------------------------------------------------------------------------------------

def test_numbers_of_thousands_of_digits() -> None:
    message = recipe_error(BASE + "calibration: {samples: " + "9" * 5000 + "}\n")
    assert "line 5" in message and "5000 characters" in message and "9" * 100 not in message
    message = recipe_error(BASE + "calibration: {seed: " + "9" * 4000 + "}\n")
    assert "calibration.seed" in message and "whole number of about 4000 digits" in message


@pytest.mark.parametrize("section", [
    "gates: {max_ppl_increase_pct: .nan}", "gates: {max_mean_kld: .inf}", "gates: {min_top1_agreement_pct: -.inf}",
    "gates: {min_decode_tokens_per_s: 1.0e400}",
])
def test_nan_and_inf_are_refused(section: str) -> None:
    message = recipe_error(BASE + section + "\n")
    assert "gates." in message and "finite number" in message


def test_nan_in_algorithm_options_is_one_problem() -> None:
    text = BASE.replace("ignore: [lm_head]", "ignore: [lm_head], algorithm: gptq, options: {dampening: .inf}")
    message = recipe_error(text)
    assert "(1 problem)" in message and "quantization.options.dampening" in message and "finite" in message


@pytest.mark.parametrize("field, value, needle", [
    ("calibration", "{seed: -1}", None),
    ("eval", "{throughput_batch_sizes: [0]}", "greater than or equal to 1"),
    ("eval", "{throughput_batch_sizes: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}", "at most 16"),
    ("gates", "{max_ppl_increase_pct: 1.0e9}", "less than or equal to 1000000"),
])
def test_numeric_ranges(field: str, value: str, needle: str | None) -> None:
    if needle is None:
        assert parse_recipe(BASE + f"{field}: {value}\n").calibration.seed == -1
    else:
        assert needle in recipe_error(BASE + f"{field}: {value}\n")


# --- regular expressions ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["re:\\", "re:(", "re:[", "re:*", "re:a{2,1}"])
def test_bad_ignore_regexes_are_recipe_errors(pattern: str) -> None:
    text = BASE.replace("ignore: [lm_head]", f"ignore: [lm_head, {json.dumps(pattern)}]")
    message = recipe_error(text)
    assert "quantization.ignore" in message and "not a valid regular expression" in message
    assert "escape special characters" in message


def test_good_ignore_regex_is_kept() -> None:
    r = parse_recipe(BASE.replace("ignore: [lm_head]", "ignore: [lm_head, 're:.*\\.mlp\\..*']"))
    assert r.quantization.ignore == ("lm_head", "re:.*\\.mlp\\..*")


# A pattern Python's backtracking `re` never finishes against a module name: (.*)* tries every split of the name.
HOSTILE = "re:(.*)*x$"
_HOSTILE_CHILD = r"""
import sys, time
from llmc.quant import groups
from llmc.recipe.schema import QuantizationSection
names = [f"model.layers.{i}.{p}" for i in range(4) for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]
# imports and first compilations before the clock starts (the hostile pattern is what is timed)
groups.resolve(QuantizationSection.model_validate({"groups": [{"name": "all", "names": ["re:.*_proj$"],
                                                               "scheme": "W8A8-FP8"}]}).to_scheme(), names, 4, "llama")
for q in ({"weights": {"format": "int8", "strategy": "channel"}, "ignore": ["lm_head", sys.argv[1]]},
          {"groups": [{"name": "odd", "names": [sys.argv[1]], "scheme": "W8A16-INT8"},
                      {"name": "all", "names": ["re:.*_proj$"], "scheme": "W8A8-FP8"}]}):
    start = time.perf_counter()
    got = groups.resolve(QuantizationSection.model_validate(q).to_scheme(), names, 4, "llama")
    print(round(time.perf_counter() - start, 4), sorted(set(map(str, got.values()))))
"""


def test_a_catastrophic_regex_in_ignore_or_a_group_is_matched_in_linear_time() -> None:
    """issue 50 item 3: the patterns were compiled, then matched by Python's `re`, which never returned. A child
    process, so the old code fails on the timeout instead of hanging the suite."""
    r = subprocess.run([sys.executable, "-c", _HOSTILE_CHILD, HOSTILE], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 0, r.stderr[-2000:]
    (t_ignore, ignore_groups), (t_groups, group_names) = [line.split(" ", 1) for line in r.stdout.splitlines()]
    # Python's backtracking never returned here; a bound far above RE2's ~1 ms, so a loaded machine does not fail it
    assert float(t_ignore) < 10.0 and float(t_groups) < 10.0
    # nothing ends in x: the pattern selects nothing, the plain scheme quantizes everything, `all` takes every Linear
    assert ignore_groups == "['']" and group_names == "['all']"


@pytest.mark.parametrize("pattern", ["re:(.*)\\1", "re:.*(?=_proj)", "re:.*(?<!lm)_head", "re:(?>a+)b", "re:a++"])
def test_a_pattern_the_linear_time_matcher_cannot_run_is_refused_by_name(pattern: str) -> None:
    text = BASE.replace("ignore: [lm_head]", f"ignore: [lm_head, {json.dumps(pattern)}]")
    message = recipe_error(text)
    assert "quantization.ignore" in message and repr(pattern) in message
    assert "does not run" in message and "fix: rewrite it without them" in message


def test_a_backreference_in_a_group_is_exit_2_from_plan_before_any_weight_loads(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text(BASE.replace("ignore: [lm_head]", "ignore: [lm_head], groups: [{name: g, names: ['re:(q|k)\\1_proj'], "
                              "scheme: W8A8-FP8}]").replace("weights: {format: int8, strategy: channel}, ", ""))
    result = CliRunner().invoke(main, ["plan", str(f), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 2, result.output
    assert "groups" in result.output and "names" in result.output and "'re:(q|k)\\\\1_proj'" in result.output
    assert "backreferences" in result.output and "rewrite it without them" in result.output
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.safetensors"))


def test_an_artifacts_config_pattern_the_matcher_cannot_run_is_exit_7_naming_the_key(tmp_path: Path) -> None:
    from llmc.engines.torch_stream import check_config_patterns

    qcfg = {"ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear", "re:(.)\\1"]}}}
    with pytest.raises(InputError) as e:
        check_config_patterns(tmp_path, qcfg)
    assert e.value.exit_code == 7 and "quantization_config.config_groups.group_0.targets" in e.value.message
    assert "'re:(.)\\\\1'" in e.value.message
    check_config_patterns(tmp_path, {"ignore": ["lm_head", "re:.*\\.mlp\\..*"], "config_groups": {}})


def test_ordinary_patterns_match_as_pythons_re_did() -> None:
    from llmc.quant.canonical import module_matches

    names = ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.12.mlp.down_proj", "model.embed_tokens",
             "model.layers.3.mlp.experts.7.up_proj", "model.layers.3.mlp.gate"]
    patterns = ["re:.*\\.mlp\\..*", "re:model\\.layers\\.\\d+\\.self_attn", "re:.*(q|k|v)_proj$", "re:lm_head",
                "re:^model\\.layers\\.(?:1|3)\\.(?:mlp\\.experts\\.\\d+\\.up_proj)$", "re:(?i)MODEL\\.EMBED", "re:mlp",
                "gate", "mlp.down_proj", "down_proj", "lm_head"]
    for p in patterns:
        for n in names:
            old = bool(re.match(p[3:], n)) if p.startswith("re:") else (n == p or n.endswith("." + p))
            assert module_matches(n, [p]) == old, (p, n)


# --- the recipe file ----------------------------------------------------------------------------------------------

def test_non_utf8_recipe_names_the_byte(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_bytes(BASE.encode() + b"# caf\xe9\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(f)
    assert "not UTF-8" in e.value.message and "0xe9" in e.value.message
    assert f"offset {len(BASE) + 5}" in e.value.message and "line 5" in e.value.message and "UTF-8" in e.value.fix


def test_recipe_symlink_loop_and_directory(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(RecipeError, match="symlink loop"):
        load_recipe(tmp_path / "a")
    with pytest.raises(RecipeError, match="is a directory, not a regular file"):
        load_recipe(tmp_path)


def test_a_system_file_is_not_echoed(tmp_path: Path) -> None:
    """Pointed at a file of many `key: value` lines (some with terminal escapes), the error lists 10 problems,
    each value cut short and escaped."""
    secret = "s3cr3t-" + "x" * 200
    f = tmp_path / "system.conf"
    f.write_text("".join(f"\"\\e[31m{secret}{i}\": 1\n" for i in range(300)))
    result = CliRunner().invoke(main, ["plan", str(f)])
    assert result.exit_code == 2
    assert result.stderr.count("\n  - ") == 11 and "unknown key" in result.stderr
    assert re.search(r"more \(30\d in all\)", result.stderr)
    assert secret not in result.stderr and "\x1b" not in result.stderr
    assert len(result.stderr) < 3000


def test_fifo_and_dev_zero_as_recipe_and_as_model_source(tmp_path: Path) -> None:
    """The cases that hung or read 4.5 GB: one child process (one torch import) tries all four, each in-process
    under its own alarm, so a regression fails here instead of hanging the suite."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    recipe = tmp_path / "r.yaml"
    script = textwrap.dedent(f"""
        import json, signal
        from click.testing import CliRunner
        from llmc.cli import main
        out = []
        for name, args in [("fifo recipe", [{str(fifo)!r}]), ("dev-zero recipe", ["/dev/zero"]),
                           ("fifo source", ["fifo-source.yaml"]), ("dev-zero source", ["zero-source.yaml"])]:
            signal.alarm(20)
            r = CliRunner().invoke(main, ["--quiet", "plan", *args])
            signal.alarm(0)
            out.append([name, r.exit_code, r.stderr])
        # VmHWM: this process's own peak (ru_maxrss would carry the forking pytest process's RSS across exec)
        hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
        print(json.dumps({{"results": out, "peak_mb": int(hwm.split()[1]) // 1024}}))
    """)
    (tmp_path / "fifo-source.yaml").write_text(BASE.replace("demo:smollm2-135m", str(fifo)))
    (tmp_path / "zero-source.yaml").write_text(BASE.replace("demo:smollm2-135m", "/dev/zero"))
    recipe.write_text(script)
    env = dict(os.environ, LLMC_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, str(recipe)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    peak_mb = report["peak_mb"]  # the child's own peak (RUSAGE_CHILDREN would include every earlier test's children)
    results = {name: (code, err) for name, code, err in report["results"]}
    assert results["fifo recipe"][0] == 2 and "FIFO (named pipe), not a regular file" in results["fifo recipe"][1]
    assert results["dev-zero recipe"][0] == 2 and "character device" in results["dev-zero recipe"][1]
    assert results["fifo source"][0] == 7 and "FIFO (named pipe), not a model file" in results["fifo source"][1]
    assert results["dev-zero source"][0] == 7 and "character device" in results["dev-zero source"][1]
    assert peak_mb < 2048, f"peak RSS {peak_mb} MB"


# --- messages -----------------------------------------------------------------------------------------------------

def test_cpu_only_rule_on_a_gpu_arch_is_a_message_not_a_crash() -> None:
    """ONNX Runtime's FP8 Q/DQ rule has no GPU arch; the message builder used to add None to a string."""
    from llmc.planning.plan import make_plan

    r = parse_recipe(BASE.replace("{format: int8, strategy: channel}", "{format: fp8_e4m3, strategy: channel}, "
                                  "activations: {format: fp8_e4m3, strategy: tensor}")
                     .replace("{runtime: vllm}", "{runtime: onnxruntime, gpu_arch: sm90}"))
    from llmc.errors import IncompatibleTargetError

    with pytest.raises(IncompatibleTargetError) as e:
        make_plan(r)
    assert "onnxruntime runs W8A8-FP8 on CPU only, gpu_arch is sm90" in e.value.message
    assert "gpu_arch: cpu" in e.value.fix


def test_control_characters_in_input_are_escaped_in_messages(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text(BASE.replace("demo:smollm2-135m", "\"demo:\\e]0;pwned\\a\\e[31m\""))
    result = CliRunner().invoke(main, ["plan", str(f), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 7 and "unknown demo model" in result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr and "\\x1b" in result.stderr


# --- model sources ------------------------------------------------------------------------------------------------

def _copy(model: Path, tmp_path: Path) -> Path:
    out = tmp_path / "m"
    shutil.copytree(model, out)
    return out


@pytest.mark.parametrize("value, needle", [
    (10**12, "hidden_size is 1000000000000, not a whole number in [1, 262,144]"),
    (-64, "hidden_size is -64"), ("64", "hidden_size is '64'"), (64.0, "hidden_size is 64.0"), (None, "no hidden_size"),
])
def test_absurd_config_sizes(tiny_model_session: Path, tmp_path: Path, value, needle: str) -> None:
    m = _copy(tiny_model_session, tmp_path)
    config = json.loads((m / "config.json").read_text())
    config["hidden_size"] = value
    (m / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as e:
        read_model_config(m)
    assert needle in e.value.message and e.value.exit_code == 7


@pytest.mark.parametrize("text, needle", [
    (b"{not json", "is not JSON"), (b"[1, 2]", "a JSON list, not an object"), (b"\xff\xfe", "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "cannot be read as JSON"), (b'{"hidden_size": 64}', "no model_type"),
])
def test_bad_config_json(tiny_model_session: Path, tmp_path: Path, text: bytes, needle: str) -> None:
    m = _copy(tiny_model_session, tmp_path)
    (m / "config.json").write_bytes(text)
    with pytest.raises(InputError, match=needle):
        resolve_source(str(m), Store(tmp_path / "c"))


def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    new = json.dumps(edit(header)).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n:])


def test_safetensors_header_length_lies(tiny_model_session: Path, tmp_path: Path) -> None:
    m = _copy(tiny_model_session, tmp_path)
    w = m / "model.safetensors"
    w.write_bytes(struct.pack("<Q", 2**63) + w.read_bytes()[8:])
    with pytest.raises(InputError, match=r"header length its first 8 bytes give does not fit") as e:
        check_safetensors_header(w)
    assert "9223372036854775808" not in str(e.value)  # the file's bytes are never quoted


def test_safetensors_header_not_an_object_or_entries_wrong(tiny_model_session: Path, tmp_path: Path) -> None:
    m = _copy(tiny_model_session, tmp_path)
    w = m / "model.safetensors"
    original = w.read_bytes()
    _rewrite_header(w, lambda h: [1, 2])
    with pytest.raises(InputError, match="the header is a JSON list"):
        CheckpointReader(m)
    for field, value, needle in [("shape", [-1, 4], "has shape"), ("data_offsets", [10, 2], "has data_offsets"),
                                 ("dtype", None, "has no dtype"), ("dtype", "Q4_K", "unknown dtype .Q4_K."),
                                 ("shape", [1, 1], "bytes, its offsets span")]:
        w.write_bytes(original)
        name = next(k for k in json.loads(original[8:8 + struct.unpack("<Q", original[:8])[0]]) if k != "__metadata__")
        _rewrite_header(w, lambda h: {**h, name: {**h[name], field: value}})
        with pytest.raises(InputError, match=needle):
            check_safetensors_header(w)


def test_safetensors_data_shorter_than_header_says(tiny_model_session: Path, tmp_path: Path) -> None:
    m = _copy(tiny_model_session, tmp_path)
    w = m / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1])
    with pytest.raises(InputError, match="truncated or padded"):
        resolve_source(str(m), Store(tmp_path / "c"))


def test_weights_that_are_not_files(tiny_model_session: Path, tmp_path: Path) -> None:
    m = _copy(tiny_model_session, tmp_path)
    (m / "model.safetensors").unlink()
    os.mkfifo(m / "model.safetensors")
    with pytest.raises(InputError, match="FIFO"):
        resolve_source(str(m), Store(tmp_path / "c"))
    (m / "model.safetensors").unlink()
    (m / "model.safetensors").mkdir()
    with pytest.raises(InputError, match="is a directory, not a regular file"):
        resolve_source(str(m), Store(tmp_path / "c"))


def test_tokenizer_fifo_is_refused(tiny_model_session: Path, tmp_path: Path) -> None:
    m = _copy(tiny_model_session, tmp_path)
    (m / "tokenizer.json").unlink()
    os.mkfifo(m / "tokenizer.json")
    with pytest.raises(InputError, match="tokenizer file .* FIFO"):
        resolve_source(str(m), Store(tmp_path / "c"))


def test_model_source_symlink_loop_and_devices(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(InputError, match="symlink loop"):
        resolve_source(str(tmp_path / "a"), Store(tmp_path / "c"))
    with pytest.raises(InputError, match="character device, not a model file or folder"):
        resolve_source("/dev/zero", Store(tmp_path / "c"))


def _gguf_bytes(tmp_path: Path) -> bytes:
    import gguf
    import numpy as np

    path = tmp_path / "written.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["a", "b"])
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    path.unlink()
    return data


@pytest.mark.parametrize("mangle, needle", [
    (lambda d: d[:-10], "truncated"),
    (lambda d: d[:30], "more than its 30 bytes hold"),
    (lambda d: d[:90], "runs past the end"),
    (lambda d: b"GGUF" + struct.pack("<I", 3) + struct.pack("<QQ", 2**60, 2**60) + d[24:], "more than its"),
    (lambda d: b"GGUF" + struct.pack("<I", 7) + d[8:], "version 7"),
    (lambda d: b"GGML" + d[4:], "not b'GGUF'"),
])
def test_corrupted_gguf_is_named_before_transformers(tmp_path: Path, mangle, needle: str) -> None:
    f = tmp_path / "m.gguf"
    good = _gguf_bytes(tmp_path)
    check_gguf_header_ok = tmp_path / "ok.gguf"
    check_gguf_header_ok.write_bytes(good)
    check_gguf_header(check_gguf_header_ok)
    f.write_bytes(mangle(good))
    start = time.monotonic()
    with pytest.raises(InputError, match=needle) as e:
        resolve_source(str(f), Store(tmp_path / "c"))
    assert time.monotonic() - start < 2 and "could not read" in e.value.message


@pytest.mark.parametrize("cache", ["/dev/null", "/etc/passwd/x"])
def test_cache_that_cannot_be_a_directory(tmp_path: Path, cache: str) -> None:
    f = tmp_path / "r.yaml"
    f.write_text(BASE)
    result = CliRunner().invoke(main, ["plan", str(f)], env={"LLMC_CACHE": cache})
    assert result.exit_code == 7 and "cannot be used as a directory" in result.stderr and "LLMC_CACHE" in result.stderr


def test_corrupted_hash_memo_is_rebuilt(tiny_model_session: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "c")
    (store.root / "file-hashes.json").write_text("[1, 2]")
    first = resolve_source(str(tiny_model_session), store).sha256
    (store.root / "file-hashes.json").write_bytes(b"\xff")
    assert resolve_source(str(tiny_model_session), store).sha256 == first


@pytest.mark.parametrize("bad", ["fifo", "latin1"])
def test_corpus_file_that_is_not_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """A Brown directory (LLMC_BROWN_DIR) with a FIFO or a non-UTF-8 file among its 500: named, no hang."""
    from llmc.calibration.corpora import brown_documents

    root = tmp_path / "brown"
    root.mkdir()
    names = [f"c{chr(97 + i // 100 % 18)}{i % 100:02d}" for i in range(500)]
    for n in names:
        (root / n).write_text("The/at jury/nn said/vbd ./.\n")
    victim = root / names[9]  # the first eval-split file
    victim.unlink()
    if bad == "fifo":
        os.mkfifo(victim)
    else:
        victim.write_bytes(b"caf\xe9/nn ./.\n")
    monkeypatch.setenv("LLMC_BROWN_DIR", str(root))
    with pytest.raises(InputError, match="FIFO" if bad == "fifo" else "not UTF-8 text: byte 0xe9 at offset 3"):
        brown_documents("eval")


def test_a_non_utf8_file_is_named_with_the_bad_bytes_and_why(tmp_path: Path) -> None:
    from llmc.inputs.files import read_input_text

    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"fine\nab\xe2\x28\xa1 more")  # a 3-byte lead followed by an ASCII byte
    with pytest.raises(InputError) as e:
        read_input_text(bad, "the file", 1 << 20, fix="save it as UTF-8")
    assert "byte 0xe2 at offset 7 (line 2: invalid continuation byte)" in e.value.message
