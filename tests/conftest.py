"""Shared fixtures: tiny random Hugging Face models (with a real tokenizer) built inside the tests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("LLMC_PROGRESS_JSON", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TOKENIZER_TEXT = (
    "The jury said it did find that many of the voters had been registered. "
    "It is a truth universally acknowledged that a single man in possession of a good fortune "
    "must be in want of a wife. To be, or not to be, that is the question. "
    "In the beginning God created the heaven and the earth. 0123456789 ,.;:!?'\"()-\n"
)


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained in milliseconds, with BOS/EOS, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_tiny_model(
    folder: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    seed: int = 0,
    tie: bool = True,
) -> Path:
    """Save a random tiny causal LM + tokenizer as a Hugging Face safetensors folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    model_type = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}[arch]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so quantization error is visible
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return Path(folder)


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    return make_tiny_model(tmp_path / "tiny")


def folder_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


_SHARED_MODELS: dict[Path, dict[str, str]] = {}  # session-wide model folders -> their files' hashes when made


@pytest.fixture(scope="session")
def tiny_model_session(tmp_path_factory) -> Path:
    """One tiny model for the whole session: read it, never write it (copy it first: shutil.copytree). Every later
    test, and every module-scoped fixture built from it, would see the change (`_shared_models_unchanged`)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    _SHARED_MODELS[folder] = folder_digest(folder)
    return folder


@pytest.fixture
def store(tmp_path: Path):
    from llmc.storage.store import Store

    return Store(tmp_path / "cache")


@pytest.fixture
def tiny_model_factory():
    """make_tiny_model itself, for tests that need several shapes."""
    return make_tiny_model


@pytest.fixture(autouse=True)
def _shared_models_unchanged(request):
    """A test that writes into the session's shared tiny model fails here, named, instead of changing what every
    later test builds from (an export sized from an edited config.json, say) far from the cause."""
    yield
    for folder, digest in _SHARED_MODELS.items():
        now = folder_digest(folder)
        if now != digest:
            changed = sorted(n for n in digest.keys() | now.keys() if digest.get(n) != now.get(n))
            _SHARED_MODELS[folder] = now  # report it once, at the test that did it
            pytest.fail(f"{request.node.nodeid} changed the shared tiny_model_session ({', '.join(changed)}); "
                        "copy it first (shutil.copytree) and change the copy", pytrace=False)


# Each real rate probe's timed runs as first measured in this session, by (probe key, runs, torch threads).
_SESSION_RATES: dict[tuple[str, int, int], tuple[float, ...]] = {}


@pytest.fixture(autouse=True, scope="session")
def _rates_probed_once_per_session():
    """A plan times each rate probe 5 x >= 0.25 s (llmc.planning.probes) and each test's fresh cache forgets them:
    ~30 s of probes per plan or build, most of the suite's time. Here a real probe (a timer from llmc) is timed once
    per session and replayed into every later cache that lacks it, through RateBook.probe itself (kept, written to
    the cache's rates file, pooled), as one cache shared by every test would. A test's own pinned or counted timers
    (test_plan_honest, test_plan_probes) are called as before; subprocesses (`llmc` run as a command) probe their
    own."""
    from llmc.planning import probes

    measure = probes.RateBook.probe

    def probe(self, key: str, run_once, repeats: int = probes.REPEATS, max_age_s: float | None = None):
        if not getattr(run_once, "__module__", "").startswith("llmc."):
            return measure(self, key, run_once, repeats, max_age_s)
        pooled = (key, repeats, torch.get_num_threads())
        if pooled in _SESSION_RATES:
            replay = iter(_SESSION_RATES[pooled])
            return measure(self, key, lambda: next(replay), repeats, max_age_s)
        samples: list[float] = []

        def timed() -> float:
            samples.append(run_once())
            return samples[-1]

        found = measure(self, key, timed, repeats, max_age_s)
        if len(samples) == repeats:
            _SESSION_RATES[pooled] = tuple(samples)
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probes.RateBook, "probe", probe)
        yield


@pytest.fixture(autouse=True)
def _progress_speaks_again():
    """`llmc --quiet` invoked in-process (click's CliRunner) leaves llmc.telemetry.progress quiet for every later test."""
    yield
    from llmc.telemetry.progress import set_quiet

    set_quiet(False)


@pytest.fixture(autouse=True)
def _plans_see_no_page_cache_eviction(monkeypatch):
    """On a VM that hands its free memory to its host, a plan adds the time a stage waits for new pages at the
    host's probed pace (llmc.planning.machine.host_memory_pace), and its range's slow end all of them: the host's pace
    of the moment would move every planned time, so the tests plan as on a machine without a host (test_plan_honest's
    host-pace tests set their own)."""
    import llmc.planning.plan

    monkeypatch.setattr(llmc.planning.plan, "memory_free", lambda: None)
    monkeypatch.setattr(llmc.planning.plan, "memory_from_host", lambda: False)


# --- test tiers by measured time --------------------------------------------------------------------------------
# tests/durations.json holds each test's seconds (setup + call + teardown) from the last recorded default run
# (`pytest -m "not slow" -n auto tests --record-durations tests/durations.json`, which merges into the file). A test
# that took HEAVY_SECONDS or more there is `heavy` whether or not its file says so: the fast tier
# (`-m "not slow and not integration and not heavy"`) follows what tests cost, not what their authors guessed. A
# module- or class-scoped fixture is paid by the first test that asks for it: when that test is heavy for its setup,
# every test sharing that fixture is heavy too, or the cost would move to the next one. A test not in the file yet
# is in the fast tier until the next recording.
DURATIONS = Path(__file__).with_name("durations.json")
HEAVY_SECONDS = 1.5


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", metavar="FILE", type=Path, default=None,
                     help="merge each test's seconds (setup + call + teardown) into FILE (tests/durations.json)")


def _read_durations(path: Path) -> dict[str, dict[str, float]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _shared_fixtures(item: pytest.Item) -> set[str]:
    """The module- and class-scoped fixtures `item` asks for: paid by the first test of the module that does."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
    return {name for name, chain in defs.items() if chain and chain[-1].scope in ("module", "class")}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    measured = _read_durations(DURATIONS)
    heavy_setups: set[tuple[str, str]] = set()  # (module, fixture) whose first user was heavy for its setup
    for item in items:
        seconds = measured.get(item.nodeid)
        if seconds and seconds.get("setup", 0.0) >= HEAVY_SECONDS:
            heavy_setups |= {(item.module.__name__ if item.module else "", f) for f in _shared_fixtures(item)}
    for item in items:
        if item.get_closest_marker("heavy"):
            continue
        seconds = measured.get(item.nodeid, {})
        module = item.module.__name__ if item.module else ""
        if sum(seconds.values()) >= HEAVY_SECONDS or any((module, f) in heavy_setups for f in _shared_fixtures(item)):
            item.add_marker(pytest.mark.heavy)


class _DurationRecorder:
    """Sums each test's phases as their reports arrive (from every xdist worker, on the controller) and merges them
    into the file at the end: tests this run did not run keep their earlier seconds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, dict[str, float]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        phases = self.seconds.setdefault(report.nodeid, {})
        phases[report.when] = round(phases.get(report.when, 0.0) + report.duration, 2)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        merged = _read_durations(self.path)
        merged.update(self.seconds)
        tmp = self.path.with_name(self.path.name + ".tmp")
        lines = (f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(merged.items()))
        tmp.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # a line a test: diffs read as what changed
        tmp.replace(self.path)


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--record-durations")
    if path is not None and not hasattr(config, "workerinput"):  # xdist: the controller gets every report
        config.pluginmanager.register(_DurationRecorder(path), "llmc-durations")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # each worker its share of the cores: two workers on two cores, not four threads fighting
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
