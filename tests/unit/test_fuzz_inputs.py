"""Property-based fuzzing of everything `llmc plan` reads: recipes and model sources.

Recipes come from the schema (`Recipe.model_json_schema()`) and from the shipped recipes, then are mutated as
data (types, ranges, unicode, NaN/inf, huge numbers, regexes, unknown keys, nesting) and as text (YAML tags,
anchors, billion laughs, deep nesting, huge digits, bad bytes, truncation). Model sources are a tiny real
model corrupted (truncated/flipped/lying safetensors headers, bad config.json, corrupted GGUF, pickles,
special files). The property, for every case: `llmc plan` (in-process through click's CliRunner) exits
with a documented code other than 70, prints no traceback and no raw control characters, finishes in
bounded time, and writes nothing outside its cache (LLMC_CACHE) - not in the working directory, not in $HOME.

Frontier recipes (issue 50) are built field by field (groups, every scheme, options, kv_cache, devices, search,
targets) on the tiny Llama and tiny models of the newer MoE families, with `--set` overrides. Every case records its
exit code, wall time and peak RSS (tests/unit/fuzz_limits.py: at most 60 s and 4 GB), and each test function is one
class of cases whose rate cache starts empty (`ClassRates`).

The default run is a fixed-seed budget (derandomized); `-m fuzz_long` runs the long one (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis", reason="pip install -e '.[dev]' installs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llmc.cli import main  # noqa: E402
from llmc.errors import EXIT_CODES, INTERNAL_ERROR_EXIT_CODE  # noqa: E402
from llmc.engines import ENGINE_NAMES  # noqa: E402
from llmc.model.source import DEMO_MODELS  # noqa: E402
from llmc.quant.spec import ROLES  # noqa: E402
from llmc.recipe.schema import SCHEME_SETTINGS, Recipe  # noqa: E402
from llmc.runtimes.base import ARCH_ORDER  # noqa: E402
from llmc.runtimes.catalog import runtime_names  # noqa: E402
from tests.unit.fuzz_limits import MAX_CASE_S, ClassRates, measured_case  # noqa: E402
from tests.unit.timeouts import alarm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))
DOCUMENTED = (set(EXIT_CODES.values()) | {0}) - {INTERNAL_ERROR_EXIT_CODE}
PER_CASE_S = int(MAX_CASE_S)  # issue 50's bound; the machine is shared, a hang is what this catches
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u202a-\u202e\u2066-\u2069]")

DEFAULT = dict(derandomize=True, deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large, HealthCheck.filter_too_much])
LONG = dict(DEFAULT, derandomize=False)


# --- the property ----------------------------------------------------------------------------------------------



def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


class Workspace:
    """A fresh working directory with the recipe, a cache (LLMC_CACHE) and an empty $HOME."""

    def __init__(self, base: Path, monkeypatch: pytest.MonkeyPatch, rates: ClassRates) -> None:
        self.rates = rates
        self.dir = Path(tempfile.mkdtemp(dir=base))
        self.cache = self.dir / "cache"
        self.home = self.dir / "home"
        self.home.mkdir()
        monkeypatch.setenv("LLMC_CACHE", str(self.cache))
        monkeypatch.setenv("HOME", str(self.home))
        self.allowed = {"recipe.yaml", "cache", "home", "source"}

    def plan(self, recipe: bytes, protected: list[Path] = (), sets: list[str] = (),
             case_class: str = "recipes") -> tuple[int, str]:
        """Run `llmc plan` on the recipe bytes (with `--set` for each of `sets`) and assert the property; return
        (exit code, output)."""
        from click.testing import CliRunner

        (self.dir / "recipe.yaml").write_bytes(recipe)
        before = {p: _tree(p) for p in protected}
        cwd = os.getcwd()
        os.chdir(self.dir)
        start = time.monotonic()
        args = ["--quiet", "plan", "recipe.yaml", *(a for s in sets for a in ("--set", s))]
        self.rates.lend(self.cache)
        try:
            with measured_case(case_class) as record, alarm(PER_CASE_S):
                result = CliRunner().invoke(main, args)
                record["outcome"] = f"exit {result.exit_code}"
                record["probed"], record["read"] = ClassRates.used(self.cache) or (0, 0)
        finally:
            os.chdir(cwd)
        self.rates.keep(self.cache)
        took = time.monotonic() - start
        out = result.output
        shown = out[-3000:]
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            f"{type(result.exception).__name__}: {result.exception}\n{shown}")
        assert result.exit_code in DOCUMENTED, f"exit {result.exit_code}:\n{shown}"
        assert "Traceback" not in out, shown
        assert took < PER_CASE_S, f"took {took:.1f} s"
        assert not CONTROL.search(result.stderr), f"raw control characters in the error: {result.stderr[:500]!r}"
        assert len(result.stderr) < 10_000, f"an error of {len(result.stderr)} characters"
        assert set(os.listdir(self.dir)) <= self.allowed, f"wrote {set(os.listdir(self.dir)) - self.allowed}"
        assert not any(self.home.iterdir()), f"wrote into $HOME: {_tree(self.home)}"
        for p, listing in before.items():
            assert _tree(p) == listing, f"changed {p}"
        with contextlib.suppress(Exception):  # outside a hypothesis test there is nothing to record
            hypothesis.event(f"exit {result.exit_code}")
        return result.exit_code, out

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spaces = []
    rates = ClassRates(tmp_path)  # one test function is one class of cases: its rate cache starts empty

    def make() -> Workspace:
        w = Workspace(tmp_path, monkeypatch, rates)
        spaces.append(w)
        return w

    yield make
    for w in spaces:
        w.close()


@pytest.fixture
def model(tiny_model_session: Path) -> Path:
    return tiny_model_session


# --- recipes: from the schema and the shipped recipes, mutated --------------------------------------------------

SCHEMA = Recipe.model_json_schema()
DEFS = SCHEMA.get("$defs", {})
def _walk_enums(node: object, out: set) -> set:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "enum":
                out.update(x for x in v if isinstance(x, str))
            elif k == "const" and isinstance(v, str):
                out.add(v)
            else:
                _walk_enums(v, out)
    elif isinstance(node, list):
        for v in node:
            _walk_enums(v, out)
    return out


ENUMS = sorted(_walk_enums(SCHEMA, set()))


def _bounded_ints(lo: int | None, hi: int | None) -> st.SearchStrategy:
    edges = [x for b in (lo, hi) if b is not None for x in (b - 1, b, b + 1)]
    inner = st.integers(min_value=lo, max_value=hi if hi is None or lo is None or hi - lo < 10**6 else lo + 10**6)
    return st.one_of(inner, st.sampled_from(edges)) if edges else inner


def from_schema(node: dict) -> st.SearchStrategy:
    """Values of a JSON-schema node (pydantic's), edges of every range included."""
    if "$ref" in node:
        return from_schema(DEFS[node["$ref"].rsplit("/", 1)[-1]])
    if "anyOf" in node:
        return st.one_of([from_schema(n) for n in node["anyOf"]])
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "object":
        props = node.get("properties", {})
        if not props:
            values = from_schema(node["additionalProperties"]) if isinstance(node.get("additionalProperties"), dict) \
                else st.integers()
            keys = st.sampled_from(["alpha", "smooth", "dampening", "block_size", "act_order", "n_grid", "clip",
                                    "search", "max_shrink", "true_sequential"]) | st.text(max_size=8)
            return st.dictionaries(keys, values, max_size=3)
        required = set(node.get("required", []))
        return st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v) for k, v in props.items() if k not in required})
    if kind == "array":
        items = node.get("items")
        inner = from_schema(items) if items else st.integers()
        return st.lists(inner, min_size=node.get("minItems", 0), max_size=min(node.get("maxItems", 3), 3))
    if kind == "integer":
        return _bounded_ints(node.get("minimum", node.get("exclusiveMinimum")),
                             node.get("maximum", node.get("exclusiveMaximum")))
    if kind == "number":
        lo = node.get("minimum", node.get("exclusiveMinimum"))
        hi = node.get("maximum", node.get("exclusiveMaximum"))
        edges = [x for b in (lo, hi) if b is not None for x in (b, b * 1.0000001 + 1e-9, -b)]
        return st.one_of(st.floats(min_value=lo, max_value=hi, allow_nan=False), st.sampled_from(edges or [0.0]))
    if kind == "string":
        if "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True)
        return st.text(max_size=20)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.none()


def _shipped(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


SHIPPED_TREES = [_shipped(p) for p in SHIPPED]

NASTY_SCALARS = st.sampled_from([
    None, True, False, 0, -1, 1, 3, 17, 2**31, 2**63, 2**64, -(2**63) - 1, 10**50, 1e308, -1e308, 1e-320,
    float("nan"), float("inf"), float("-inf"), "", " ", "0", "1e3", "true", "null", "~", "re:", "re:(", "re:[",
    "re:*", "re:\\", "re:(?P<x", "re:a{99999999999}", "re:.*", "re:lm_head", "lm_head", "demo:", "demo:gpt-5",
    "demo:\x1b[31m", "../../etc/passwd", "/etc/passwd", "/dev/zero", "/dev/null", "/", ".", "~", "\x00",
    "\x1b]0;pwned\x07", "\u202eevil", "é" * 30, "x" * 5000, "a\nb: c", "{a: 1}", "[1, 2]", "*alias", "&anchor",
    "!!python/object:os.system", "1_000", "0x1f", "0o17", "190:20:30", "2001-13-45", ".inf", ".nan",
])
NASTY = st.one_of(
    NASTY_SCALARS,
    st.sampled_from(ENUMS),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),
    st.text(max_size=30),
    st.text(alphabet="()[]{}*+?.\\|^$ab-,0123456789:", max_size=12).map(lambda s: "re:" + s),
    st.lists(st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
)


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _get(node: object, path: tuple) -> object:
    for p in path:
        node = node[p]
    return node


@st.composite
def mutated_tree(draw, base: st.SearchStrategy) -> object:
    tree = json.loads(json.dumps(draw(base), default=str))  # a deep copy
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):  # a third reach the model and the planner
        paths = _paths(tree)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["enum", "enum", "enum", "number", "number", "replace", "replace", "delete",
                                   "unknown_key", "wrap", "nest"]))
        if not path:
            if op == "replace":
                tree = draw(NASTY)
            continue
        parent, key = _get(tree, path[:-1]), path[-1]
        if op == "replace":
            parent[key] = draw(NASTY)
        elif op == "enum":
            parent[key] = draw(st.sampled_from(ENUMS))
        elif op == "number":  # near the ranges recipes use, so that many still plan: bounds and shape checks
            parent[key] = draw(st.one_of(st.integers(-2, 5000), st.sampled_from([2**k for k in range(14)]),
                                         st.floats(-1, 200, allow_nan=False)))
        elif op == "delete":
            del parent[key]
        elif op == "unknown_key" and isinstance(parent[key], dict):
            parent[key][draw(st.text(max_size=12))] = draw(NASTY)
        elif op == "wrap":
            parent[key] = [parent[key]] if draw(st.booleans()) else {"x": parent[key]}
        elif op == "nest":
            value = parent[key]
            for _ in range(draw(st.integers(1, 40))):
                value = [value]
            parent[key] = value
    return tree


def _with_model(tree: object, source: str, anyway: bool) -> object:
    """Point the recipe at the tiny model when it names a real demo (unpacking one takes a minute) or, mostly, anyway."""
    if isinstance(tree, dict) and isinstance(tree.get("model"), dict):
        s = tree["model"].get("source")
        if isinstance(s, str) and (s.startswith("demo:") and s[5:].strip() in DEMO_MODELS or anyway):
            tree["model"]["source"] = source
    return tree


TAGS = ["!!float ", "!!int ", "!!str ", "!!bool ", "!!null ", "!!binary ", "!!timestamp ", "!!set ", "!!omap ",
        "!!map ", "!!seq ", "!!python/object:os.system ", "!!python/name:os.system ", "!foo ", "!<tag:x> ", "! "]


def laughs(levels: int) -> str:
    lines = ["l0: &l0 [a, a, a, a, a, a, a, a, a]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@st.composite
def text_mutation(draw, text: str) -> bytes:
    op = draw(st.sampled_from(["none"] * 8 + ["tag", "anchor", "laughs", "recursive", "digits", "deep", "keys",
                               "byte", "truncate", "bom", "crlf", "duplicate", "documents", "laughs_in_field"]))
    value_starts = [m.end() for m in re.finditer(r": |- ", text)] or [len(text)]
    at = draw(st.sampled_from(value_starts))
    if op == "tag":
        text = text[:at] + draw(st.sampled_from(TAGS)) + text[at:]
    elif op == "anchor":
        text = text[:at] + draw(st.sampled_from(["&a ", "*a ", "*undefined ", "&a *a "])) + text[at:]
    elif op == "laughs":
        text = laughs(draw(st.integers(1, 12))) + text
    elif op == "laughs_in_field":
        text = laughs(draw(st.integers(3, 9))) + text.replace("ignore:", "ignore: *l%d\nxignore:" % draw(
            st.integers(1, 3)), 1)
    elif op == "recursive":
        text = draw(st.sampled_from(["r: &r [*r]\n", "r: &r {a: *r}\n", "r: &r [[[*r]]]\n"])) + text
    elif op == "digits":
        digits = draw(st.sampled_from([20, 400, 4300, 4301, 5000, 50000]))
        text = text[:at] + draw(st.sampled_from(["", "-", "0x", "1."])) + "9" * digits + "\n" + text[at:]
    elif op == "deep":
        n = draw(st.sampled_from([10, 31, 32, 33, 100, 1000, 20000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ("{a: ", "}")]))
        text = text + "deep: " + opener * n + "1" + closer * n + "\n"
    elif op == "keys":
        n = draw(st.sampled_from([999, 1000, 1001, 5000, 30000]))
        text = text + "many: {" + ", ".join(f"k{i}: 1" for i in range(n)) + "}\n"
    elif op == "duplicate":
        text = text + text.split("\n", 1)[0] + "\n"
    elif op == "documents":
        text = text + "---\n" + text
    data = text.encode("utf-8")
    if op == "byte" and data:
        pos = draw(st.integers(0, len(data) - 1))
        data = data[:pos] + bytes([draw(st.sampled_from([0x00, 0x07, 0x1b, 0x80, 0xc3, 0xfe, 0xff]))]) + data[pos + 1:]
    elif op == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif op == "bom":
        data = b"\xef\xbb\xbf" + data
    elif op == "crlf":
        data = data.replace(b"\n", b"\r\n")
    return data


def _dump(tree: object) -> str:
    try:
        return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)
    except (yaml.YAMLError, ValueError):  # an int past the 4300-digit repr limit
        return "name: x\n"


@st.composite
def recipes(draw, source: str) -> bytes:
    base = st.sampled_from(SHIPPED_TREES) if draw(st.integers(0, 2)) else from_schema(SCHEMA)
    tree = _with_model(draw(mutated_tree(base)), source, draw(st.integers(0, 9)) < 7)
    return draw(text_mutation(_dump(tree)))


# --- recipes with the frontier fields (issue 50): groups, every scheme, options, kv_cache, devices, search, targets,
# `--set` overrides; drawn valid-looking first so that most reach the planner, then mutated like the others

SCHEME_NAMES = sorted(SCHEME_SETTINGS)
ALGORITHMS = ["rtn", "gptq", "awq", "smoothquant", "scale_search", "smoothquant+gptq", ["smoothquant", "gptq"],
              "awq+gptq", "gptq+rtn"]
OPTION_VALUES: dict[str, st.SearchStrategy] = {
    "block_size": st.sampled_from([1, 16, 64, 128, 129, 4096, 0, -1]),
    "dampening": st.sampled_from([0.0, 0.01, 0.1, 1.0, -0.5, 1e9]),
    "act_order": st.booleans(), "true_sequential": st.booleans(),
    "block_scales": st.sampled_from(["absmax", "search", "other"]),
    "n_grid": st.sampled_from([1, 2, 20, 0, 10**6]), "search": st.sampled_from(["grid", "refine", "x"]),
    "duo_scaling": st.booleans(), "clip": st.booleans(), "clip_grid": st.sampled_from([1, 20, 0]),
    "max_shrink": st.sampled_from([0.0, 0.5, 0.99, 1.0, -0.1]),
    "alpha": st.sampled_from([0.0, 0.5, 0.8, 1.0, 1.5, -1.0]), "smooth": st.sampled_from(["norms", "all", "none"]),
    "propagate": st.sampled_from(["original", "quantized", "x"]),
}
NAME_SELECTORS = ["q_proj", "o_proj", "down_proj", "gate_proj", "mlp.experts", "shared_expert", "lm_head",
                  "model.layers.0.self_attn.q_proj", "re:.*mlp.*", "re:model\\.layers\\.1\\..*", "re:(.*)*x$",
                  "kv_a_proj_with_mqa", "in_proj_qkvz", "router", "gate", "nothing_matches"]
LAYER_SELECTORS = ["first 1", "last 1", "0", "1", "0-1", 0, 1, 5, "1-0", "first 0", "last 99"]
TARGET_VERSIONS = [None, ">=0.9", ">=0.9,<0.12", "<0.5", "==1.0", "bad version"]


def _scheme_quant(draw, scheme: str) -> dict:
    """A scheme's weights/activations as a recipe writes them, sometimes with another group size or symmetry."""
    settings = json.loads(json.dumps(SCHEME_SETTINGS[scheme]))
    weights = settings["weights"]
    if weights["format"] == "int4" and draw(st.booleans()):
        weights["group_size"] = draw(st.sampled_from([16, 32, 64, 128, 256, 48]))
        weights["symmetric"] = draw(st.booleans())
        if draw(st.booleans()):
            weights["scale_grid"] = draw(st.sampled_from(["float", "fp8_row"]))
    if weights["format"] in ("int8", "fp8_e4m3") and weights["strategy"] == "channel" and draw(st.booleans()):
        weights["strategy"] = "tensor"
    return settings


@st.composite
def group_sections(draw) -> list[dict]:
    groups = []
    for i in range(draw(st.integers(1, 3))):
        group: dict = {"name": f"g{i}"}
        kind = draw(st.sampled_from(["scheme", "scheme", "weights", "ignore"]))
        if kind == "scheme":
            group["scheme"] = draw(st.sampled_from(SCHEME_NAMES))
        elif kind == "weights":
            group.update(_scheme_quant(draw, draw(st.sampled_from(SCHEME_NAMES))))
        else:
            group["ignore"] = True
        selectors = draw(st.sets(st.sampled_from(["names", "roles", "layers"]), min_size=1))
        if draw(st.integers(0, 3)) == 0:
            selectors.add("exclude_layers")
        if "names" in selectors:
            group["names"] = draw(st.lists(st.sampled_from(NAME_SELECTORS), min_size=1, max_size=3, unique=True))
        if "roles" in selectors:
            group["roles"] = draw(st.lists(st.sampled_from(list(ROLES)), min_size=1, max_size=3, unique=True))
        if "layers" in selectors:
            group["layers"] = draw(st.lists(st.sampled_from(LAYER_SELECTORS), min_size=1, max_size=2))
        if "exclude_layers" in selectors:
            group["exclude_layers"] = draw(st.lists(st.sampled_from(LAYER_SELECTORS), min_size=1, max_size=2))
        groups.append(group)
    if draw(st.booleans()):  # a catch-all last group, so that every Linear is in one (the plan checks it)
        groups.append({"name": "rest", "scheme": draw(st.sampled_from(SCHEME_NAMES)), "layers": ["0-1"]})
    return groups


HOPPER_CANDIDATES = ["W4A16-NVFP4", "W8A8-FP8", "W4A16-INT", "W8A16-FP8", "W8A8-INT8", "bf16"]  # vLLM on sm90


@st.composite
def search_sections(draw, valid: bool) -> dict:
    pool = HOPPER_CANDIDATES if valid else [*SCHEME_NAMES, "bf16"]
    candidates = draw(st.lists(st.sampled_from(pool), min_size=2, max_size=4, unique=True))
    bits = [6.0, 8.0, 12.0, 16.0, 32] if valid else [1.0, 4.5, 5.5, 8.0, 16.0, 32]
    budget = draw(st.one_of(st.builds(lambda b: {"effective_bits": b}, st.sampled_from(bits)),
                            st.builds(lambda b: {"bytes": b}, st.sampled_from([1, 10_000, 100_000, 10**9]))))
    section = {"candidates": candidates, "budget": budget,
               "granularity": draw(st.sampled_from(["layer", "role", "linear"]))}
    if draw(st.booleans()):
        section["protect"] = draw(st.lists(st.sampled_from(["first 1", "last 1", "o_proj", "re:.*down.*"]),
                                           max_size=2))
    return section


VALID_OPTIONS = {"gptq": {"block_size": [16, 64, 128], "dampening": [0.01, 0.1], "act_order": [True, False],
                          "true_sequential": [True, False]},
                 "awq": {"n_grid": [2, 20], "search": ["grid", "refine"], "duo_scaling": [True, False],
                         "clip": [True, False], "max_shrink": [0.5, 0.8]},
                 "smoothquant": {"alpha": [0.5, 0.8]}}
BLACKWELL_SCHEMES = {"W4A4-NVFP4", "W8A8-MXFP8"}  # vLLM runs them from sm100; W4AFP8 only up to sm90


def _valid_options(draw, algorithm: str) -> dict:
    table = {k: v for step in algorithm.split("+") for k, v in VALID_OPTIONS.get(step, {}).items()}
    keys = draw(st.lists(st.sampled_from(sorted(table)), max_size=2, unique=True)) if table else []
    return {k: draw(st.sampled_from(table[k])) for k in keys}


@st.composite
def quantization_sections(draw, valid: bool) -> dict:
    """`valid`: algorithms, options and scheme combinations the recipe accepts, mostly (so that most plans reach the
    model and the planner); otherwise anything of the right shape."""
    shape = draw(st.sampled_from(["scheme", "scheme", "groups", "search"]))
    if valid:  # the transforms (awq, smoothquant) and scale_search take only some schemes: the other branch
        algorithm = "rtn" if shape == "search" else draw(st.sampled_from(["rtn", "rtn", "gptq"]))
    else:
        algorithm = draw(st.sampled_from(ALGORITHMS))
    q: dict = {"algorithm": algorithm}
    if shape == "scheme":
        q.update(_scheme_quant(draw, draw(st.sampled_from(SCHEME_NAMES))))
    elif shape == "groups":
        q["groups"] = draw(group_sections())
    else:
        q["search"] = draw(search_sections(valid))
    if draw(st.booleans()):
        q["kv_cache"] = {"format": draw(st.sampled_from(["fp8_e4m3"] if valid else ["fp8_e4m3", "int8"]))}
    if valid and isinstance(algorithm, str):
        q["options"] = _valid_options(draw, algorithm)
    elif draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), max_size=3, unique=True))
        q["options"] = {k: draw(OPTION_VALUES[k]) for k in keys}
    if draw(st.booleans()):  # valid: lm_head stays ignored (the tiny models tie it to the embeddings)
        more = draw(st.lists(st.sampled_from(["lm_head", *NAME_SELECTORS[:8]]), max_size=3, unique=True))
        q["ignore"] = sorted({"lm_head", *more}) if valid else more
    return q


def _schemes_of(q: dict) -> set[str]:
    names = {g.get("scheme") for g in q.get("groups", ())} | set((q.get("search") or {}).get("candidates", ()))
    weights = q.get("weights") or {}
    for scheme, preset in SCHEME_SETTINGS.items():
        if preset["weights"]["format"] == weights.get("format") and (
                (preset.get("activations") or {}).get("format") == (q.get("activations") or {}).get("format")):
            names.add(scheme)
    return names


@st.composite
def target_lists(draw, schemes: set[str], valid: bool) -> list[dict]:
    """`valid`: first a vLLM target at an arch that runs the schemes (sm100 for Blackwell-only schemes)."""
    targets = []
    if valid:
        targets.append({"runtime": "vllm", "gpu_arch": "sm100" if schemes & BLACKWELL_SCHEMES else "sm90"})
    for _ in range(draw(st.sampled_from([0, 0, 0, 1] if valid else [1, 1, 2]))):
        t: dict = {"runtime": draw(st.sampled_from(list(runtime_names()))),
                   "gpu_arch": draw(st.sampled_from(["cpu", *ARCH_ORDER]))}
        if draw(st.booleans()):
            t["tensor_parallel"] = draw(st.sampled_from([1, 2, 4, 8, 3, 64]))
        version = draw(st.sampled_from(TARGET_VERSIONS))
        if version is not None:
            t["version"] = version
        if t["runtime"] == "tensorrt" and draw(st.booleans()):
            t["triton"] = True
        targets.append(t)
    return targets


@st.composite
def frontier_trees(draw, source: str, valid: bool) -> dict:
    quantization = draw(quantization_sections(valid))
    tree: dict = {"version": 1, "name": "frontier", "model": {"source": source}, "quantization": quantization,
                  "targets": draw(target_lists(_schemes_of(quantization), valid))}
    if draw(st.booleans()):
        tree["model"]["dtype"] = draw(st.sampled_from(["auto", "float32", "bfloat16", "float16"]))
    calibration: dict = {"samples": draw(st.sampled_from([1, 4, 32])), "seq_len": draw(st.sampled_from([16, 64, 512]))}
    for key, values in (("device", ["auto", "cpu", "cuda"]), ("packing", ["windows", "samples"]),
                        ("spill_activations", ["auto", "always", "never"]),
                        ("moe_calibrate_all_experts", [True, False]), ("moe_min_tokens", [1, 8, 10**6]),
                        ("resume_every_s", [1.0, 600.0])):
        if draw(st.integers(0, 3)) == 0:
            calibration[key] = draw(st.sampled_from(values))
    tree["calibration"] = calibration
    if draw(st.booleans()):
        tree["eval"] = {"device": draw(st.sampled_from(["auto", "cpu", "cuda"])), "seq_len": 64, "windows": 2,
                        "runtimes": draw(st.lists(st.sampled_from(list(ENGINE_NAMES)), min_size=1, max_size=3,
                                                  unique=True))}
    return tree


SET_PATHS: dict[str, st.SearchStrategy] = {
    "targets[0].gpu_arch": st.sampled_from(["cpu", *ARCH_ORDER, "sm999"]),
    "targets[0].runtime": st.sampled_from([*runtime_names(), "nope"]),
    "targets[0].tensor_parallel": st.sampled_from(["1", "2", "8", "0", "'8'"]),
    "targets": st.just("[{runtime: vllm, gpu_arch: sm100}]"),
    "quantization.kv_cache.format": st.sampled_from(["fp8_e4m3", "int8", "int4"]),
    "quantization.algorithm": st.sampled_from(["rtn", "gptq", "awq", "smoothquant+gptq", "[smoothquant, gptq]"]),
    "quantization.options.alpha": st.sampled_from(["0.5", "2", "true"]),
    "quantization.groups[0].scheme": st.sampled_from(SCHEME_NAMES),
    "quantization.search.budget.effective_bits": st.sampled_from(["4.5", "0", ".nan"]),
    "calibration.device": st.sampled_from(["cpu", "cuda", "tpu"]),
    "eval.device": st.sampled_from(["cpu", "cuda"]),
    "calibration.samples": st.sampled_from(["1", "4", "99999", "-1", "9" * 500]),
    "model.dtype": st.sampled_from(["auto", "bfloat16", "int8"]),
    "targets[9].runtime": st.just("vllm"),
}
BAD_SETS = st.sampled_from(["", "=", "novalue", "a..b=1", "x[=1", "targets[99999999].x=1", "name=[", "name=*a",
                            "name=" + "[" * 2000, "\x1b[31m=1", "quantization.ignore=['re:(.*)*x$']"])


@st.composite
def overrides(draw) -> list[str]:
    out = []
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 1, 1, 2, 3]))):
        if draw(st.integers(0, 9)) == 0:
            out.append(draw(BAD_SETS))
        else:
            path = draw(st.sampled_from(sorted(SET_PATHS)))
            out.append(f"{path}={draw(SET_PATHS[path])}")
    return out


@st.composite
def frontier_recipes(draw, sources: list[str]) -> tuple[bytes, list[str]]:
    """(recipe bytes, `--set` arguments): a frontier tree on one of `sources` (three in four drawn valid), a fifth
    mutated as data, a tenth as text, with 0-3 overrides."""
    tree = draw(frontier_trees(draw(st.sampled_from(sources)), valid=draw(st.integers(0, 3)) > 0))
    if draw(st.integers(0, 4)) == 0:
        tree = draw(mutated_tree(st.just(tree)))
    text = _dump(tree)
    data = draw(text_mutation(text)) if draw(st.integers(0, 9)) == 0 else text.encode()
    return data, draw(overrides())


# regressions found while writing this (each was an internal error, a hang or a runaway before the fix)
_T = "name: r\nmodel: {{source: {src}}}\nquantization: {{weights: {{format: int8, strategy: channel}}}}\n" \
     "targets: [{{runtime: vllm}}]\n"
REGRESSIONS = [
    _T.replace("name: r", "name: !!float 'x'"),
    laughs(9) + _T.replace("{{format: int8, strategy: channel}}}}", "{{format: int8, strategy: channel}}, ignore: *l9}}"),
    "a: &a [*a]\n" + _T,
    _T + "calibration: {{samples: " + "9" * 5000 + "}}\n",
    _T + "gates: {{max_ppl_increase_pct: .inf}}\n",
    _T.replace("strategy: channel}}", "strategy: channel}}, ignore: ['re:(']"),
    _T + "x: " + "[" * 5000 + "]" * 5000 + "\n",
    _T.replace("{{format: int8, strategy: channel}}}}", "{{format: fp8_e4m3, strategy: channel}}, activations: "
               "{{format: fp8_e4m3, strategy: tensor}}}}").replace("{{runtime: vllm}}", "{{runtime: onnxruntime}}"),
]


def _check_recipe(workspace, model: Path, recipe: bytes) -> None:
    w = workspace()
    try:
        w.plan(recipe, protected=[model])
    finally:
        w.close()


@settings(max_examples=300, **DEFAULT)
@given(data=st.data())
def test_plan_on_fuzzed_recipes(workspace, model: Path, data) -> None:
    recipe = data.draw(recipes(str(model)))
    _check_recipe(workspace, model, recipe)


@pytest.mark.parametrize("template", REGRESSIONS, ids=range(len(REGRESSIONS)))
def test_plan_on_recipe_regressions(workspace, model: Path, template: str) -> None:
    _check_recipe(workspace, model, template.format(src=model).encode())


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_RECIPES", 4500)), **LONG)
@given(data=st.data())
def test_plan_on_fuzzed_recipes_long(workspace, model: Path, data) -> None:
    _check_recipe(workspace, model, data.draw(recipes(str(model))))


NEW_FAMILIES = ["deepseek_v3", "gpt_oss", "qwen3_next", "llama4_text", "glm4_moe", "qwen3_moe"]


@pytest.fixture(scope="module")
def frontier_sources(tiny_model_session: Path, tmp_path_factory) -> list[Path]:
    """The tiny Llama and a tiny model of each newer MoE family (0.3-0.5 s each): the groups' roles (experts,
    shared_experts, router) and the families' own Linears select something real."""
    from tests.unit.families import make_tiny

    base = tmp_path_factory.mktemp("families")
    return [tiny_model_session, *(make_tiny(f, base / f) for f in NEW_FAMILIES)]


def _check_frontier(workspace, sources: list[Path], case: tuple[bytes, list[str]]) -> None:
    recipe, sets = case
    w = workspace()
    try:
        w.plan(recipe, protected=sources, sets=sets, case_class="frontier recipes")
    finally:
        w.close()


@settings(max_examples=40, **DEFAULT)
@given(data=st.data())
def test_plan_on_frontier_recipes(workspace, frontier_sources: list[Path], data) -> None:
    _check_frontier(workspace, frontier_sources, data.draw(frontier_recipes([str(p) for p in frontier_sources])))


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_FRONTIER", 5000)), **LONG)
@given(data=st.data())
def test_plan_on_frontier_recipes_long(workspace, frontier_sources: list[Path], data) -> None:
    _check_frontier(workspace, frontier_sources, data.draw(frontier_recipes([str(p) for p in frontier_sources])))


# --- model sources: a tiny real model, corrupted ------------------------------------------------------------------

def tiny_gguf() -> bytes:
    """A small GGUF written by the gguf library (llama metadata, two tensors): the seed for corrupted GGUFs."""
    import gguf
    import numpy as np

    path = Path(tempfile.mkdtemp()) / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_token_list(["<s>", "</s>", "a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    shutil.rmtree(path.parent)
    return data


def _safetensors_parts(data: bytes) -> tuple[int, dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8:8 + n]), data[8 + n:]


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                       max_leaves=8)
CONFIG_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                 "intermediate_size", "head_dim", "max_position_embeddings", "tie_word_embeddings", "model_type"]


@st.composite
def broken_sources(draw) -> Callable[[Path, Path], str]:
    """A function that lays out a broken model source in a workspace (from the tiny model) and returns its spec."""
    kind = draw(st.sampled_from(["truncate", "flip", "header_length", "header_json", "header_entry", "config_value",
                                 "config_text", "gguf_truncate", "gguf_flip", "gguf_random", "pickle_folder",
                                 "pickle_file", "special", "fine"]))
    seed = draw(st.integers(0, 2**32 - 1))
    nasty = draw(NASTY)
    jsonish = draw(JSONISH)

    def lay_out(model: Path, ws: Path) -> str:
        rng = random.Random(seed)
        src = ws / "source"
        if kind.startswith("gguf"):
            src.mkdir()
            data = GGUF_SEED
            if kind == "gguf_truncate":
                data = data[: rng.randrange(len(data))]
            elif kind == "gguf_flip":
                data = bytearray(data)
                for _ in range(rng.randrange(1, 8)):
                    data[rng.randrange(min(len(data), 600))] = rng.randrange(256)
                data = bytes(data)
            else:
                data = b"GGUF" + rng.randbytes(rng.randrange(200))
            (src / "m.gguf").write_bytes(data)
            return str(src / "m.gguf")
        if kind == "pickle_file":
            src.mkdir()
            (src / "model.pt").write_bytes(b"\x80\x04\x95" + rng.randbytes(40))
            return str(src / "model.pt")
        if kind == "special":
            choice = rng.choice(["fifo", "dev_zero", "dev_null", "loop", "empty_dir", "no_weights", "weights_dir",
                                 "weights_fifo", "config_fifo", "tokenizer_fifo", "config_dir"])
            if choice == "dev_zero":
                return "/dev/zero"
            if choice == "dev_null":
                return "/dev/null"
            if choice == "fifo":
                os.mkfifo(src)
                return str(src)
            if choice == "loop":
                os.symlink(ws / "source", src)
                return str(src)
            src.mkdir()
            if choice == "empty_dir":
                return str(src)
            shutil.copy(model / "config.json", src)
            if choice == "weights_dir":
                (src / "model.safetensors").mkdir()
            elif choice == "weights_fifo":
                os.mkfifo(src / "model.safetensors")
            elif choice in ("config_fifo", "config_dir", "tokenizer_fifo"):
                shutil.copy(model / "model.safetensors", src)
                if choice == "tokenizer_fifo":
                    os.mkfifo(src / "tokenizer.json")
                else:
                    (src / "config.json").unlink()
                    os.mkfifo(src / "config.json") if choice == "config_fifo" else (src / "config.json").mkdir()
            return str(src)
        shutil.copytree(model, src)
        weights = src / "model.safetensors"
        data = weights.read_bytes()
        n, header, body = _safetensors_parts(data)
        if kind == "truncate":
            weights.write_bytes(data[: rng.randrange(len(data))])
        elif kind == "flip":
            b = bytearray(data)
            for _ in range(rng.randrange(1, 6)):
                b[rng.randrange(min(len(b), 8 + n + 16))] = rng.randrange(256)
            weights.write_bytes(bytes(b))
        elif kind == "header_length":
            weights.write_bytes(struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, len(data), 2**63, 2**64 - 1,
                                                               rng.randrange(2**64)])) + data[8:])
        elif kind in ("header_json", "header_entry"):
            if kind == "header_json":
                new = jsonish
            else:
                new = dict(header)
                name = rng.choice([k for k in header if k != "__metadata__"])
                field = rng.choice(["dtype", "shape", "data_offsets", None])
                new[name] = nasty if field is None else {**header[name], field: nasty}
            text = json.dumps(new, default=str).encode()
            weights.write_bytes(struct.pack("<Q", len(text)) + text + body)
        elif kind == "config_value":
            config = json.loads((src / "config.json").read_text())
            key = rng.choice(CONFIG_FIELDS)
            if rng.random() < 0.2:
                config.pop(key, None)
            else:
                config[key] = rng.choice([nasty, 10**12, -1, 0, "64", None, 1.5, True, 10**400])
            (src / "config.json").write_text(json.dumps(config, default=str))
        elif kind == "config_text":
            (src / "config.json").write_bytes(rng.choice([
                json.dumps(jsonish, default=str).encode(), b"", b"\xff\xfe{", b"[" * 100_000, b"{\"a\": 1",
                b"1" * 5000, rng.randbytes(64)]))
        elif kind == "pickle_folder":
            weights.unlink()
            (src / "pytorch_model.bin").write_bytes(b"\x80\x04\x95" + rng.randbytes(40))
        return str(src)

    lay_out.__name__ = kind
    return lay_out


GGUF_SEED = b""


@pytest.fixture(scope="module")
def gguf_seed() -> bytes:
    global GGUF_SEED
    GGUF_SEED = tiny_gguf()
    return GGUF_SEED


def _check_source(workspace, model: Path, lay_out: Callable[[Path, Path], str]) -> int:
    w = workspace()
    try:
        spec = lay_out(model, w.dir)
        recipe = _T.format(src=json.dumps(spec)).encode()
        code, out = w.plan(recipe, protected=[model], case_class="model sources")
        return code
    finally:
        w.close()


@settings(max_examples=100, **DEFAULT)
@given(lay_out=broken_sources())
def test_plan_on_broken_model_sources(workspace, model: Path, gguf_seed: bytes, lay_out) -> None:
    code = _check_source(workspace, model, lay_out)
    if lay_out.__name__ not in ("fine", "config_value", "header_entry", "header_json", "flip"):
        assert code != 0, f"{lay_out.__name__}: a broken source planned cleanly"


@pytest.mark.slow
@pytest.mark.fuzz_long
@settings(max_examples=int(os.environ.get("LLMC_FUZZ_SOURCES", 1000)), **LONG)
@given(lay_out=broken_sources())
def test_plan_on_broken_model_sources_long(workspace, model: Path, gguf_seed: bytes, lay_out) -> None:
    _check_source(workspace, model, lay_out)
