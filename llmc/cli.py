"""The `llmc` command: parse, call the library, print. Exit codes: see `llmc --help` / README."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from llmc.engines import ENGINE_NAMES
from llmc.errors import (EXIT_CODES, INTERNAL_ERROR_EXIT_CODE, InputError, LlmcError, PerformanceGateError,
                         QualityGateError)

EXIT_HELP = ("Exit codes: "
             + ", ".join(f"{code} {kind}" for kind, code in sorted(EXIT_CODES.items(), key=lambda x: x[1]))
             + ". Resource exhausted: disk full or over quota, a disk I/O error, out of host or GPU memory, or an "
             "engine process killed (out-of-memory killer); finished stages are kept and a rerun resumes.")


def _run(fn, *args, **kwargs):
    """Call into the library; turn LlmcError into its message and exit code."""
    try:
        return fn(*args, **kwargs)
    except LlmcError as e:
        _fail(e)
    except KeyboardInterrupt:
        click.echo("llmc: interrupted; finished stages are cached and a rerun resumes", err=True)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the one place that reports unexpected failures
        # lazy: error path only; `llmc --help` loads just click and llmc.engines
        from llmc.storage.resource_errors import resource_error

        if (resource := resource_error(e)) is not None:  # disk full, I/O error, out of memory: never "internal"
            _fail(resource)
        import traceback  # lazy: error path only; `llmc --help` loads just click and llmc.engines

        traceback.print_exc()
        click.echo(f"llmc: internal error: {type(e).__name__}: {e}", err=True)
        sys.exit(INTERNAL_ERROR_EXIT_CODE)


def _printable(text: str, limit: int = 4000) -> str:
    """A message as printed: control characters that came from the input escaped (a name holding terminal escape
    sequences cannot drive the terminal), at most `limit` characters."""
    from llmc.inputs.excerpt import escape  # lazy: error path only; `llmc --help` loads just click and llmc.engines

    lines = [escape(line) for line in text[:limit].split("\n")]
    return "\n".join(lines) + (f"... ({len(text)} characters)" if len(text) > limit else "")


def _fail(e: LlmcError) -> NoReturn:
    click.echo(f"llmc: {e.kind}: {_printable(e.message)}", err=True)
    if e.fix:
        click.echo(f"  fix: {_printable(e.fix)}", err=True)
    sys.exit(e.exit_code)


def _relative(path: Path) -> str:
    """A path as printed: relative to the working directory when it lies under it (as the recipe names it)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


cache_option = click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
                            help="stage cache (default $LLMC_CACHE or ~/.cache/llmc)")
threads_option = click.option("--threads", type=int, default=None, help="torch CPU threads")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="override one recipe value, validated like the recipe and recorded in the manifest "
                          "(repeatable), e.g. --set model.source=/ckpts/llama70b --set targets[0].tensor_parallel=8")


def resume_every_option(command):
    """`--resume-every SECONDS`: the quantize stage's resume interval, as `--set calibration.resume_every_s=SECONDS`
    (validated and recorded like any override; the files and stage keys do not depend on it)."""
    @functools.wraps(command)
    def with_resume_every(*args, resume_every: float | None = None, overrides: tuple[str, ...] = (), **kwargs):
        if resume_every is not None:
            overrides = (*overrides, f"calibration.resume_every_s={resume_every:g}")
        return command(*args, overrides=overrides, **kwargs)

    return click.option("--resume-every", "resume_every", type=click.FloatRange(0, 86400), default=None,
                        metavar="SECONDS", help="seconds between the quantize stage's resume points (0: after every "
                        "layer; default: every layer, or every 60 s where the activations stay on a GPU); a kill "
                        "loses at most about this plus one layer (`llmc plan` prints it)")(with_resume_every)


def _reprobe(_ctx: click.Context, _param: click.Parameter, on: bool) -> None:
    if on:  # an environment variable reaches every process of the command (torchrun's ranks too)
        os.environ["LLMC_REPROBE"] = "1"  # llmc.planning.probes reads it


reprobe_option = click.option("--reprobe", is_flag=True, expose_value=False, callback=_reprobe,
                              help="measure this machine's rates again and add them to the cached ones (the plan "
                                   "reads the median of the last few probes' runs)")


@click.group(epilog=EXIT_HELP)
@click.version_option(package_name="llmc")
@click.option("-q", "--quiet", is_flag=True, help="no progress output")
def main(quiet: bool) -> None:
    """Quantize a Hugging Face causal LM into evaluated, gated, runtime-ready artifacts."""
    from llmc.telemetry.progress import set_quiet  # lazy: start-up: `llmc --help` loads just click and llmc.engines

    set_quiet(quiet)


def _load(recipe_path: Path, overrides: tuple[str, ...] = ()):
    from llmc.recipe.load import load_recipe  # lazy: start-up: `llmc --help` loads just click and llmc.engines

    return load_recipe(recipe_path, overrides)


@main.command(epilog=EXIT_HELP)
@reprobe_option
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@threads_option
@set_option
@resume_every_option
@click.option("--no-publish", is_flag=True, help="stop after the gates")
@click.option("--json", "as_json", is_flag=True, help="print report.json instead of the table")
@click.option("--junit", type=click.Path(path_type=Path), default=None,
              help="also write JUnit XML here (one test case per gate; a crashed build is an error case)")
@click.option("--report-dir", type=click.Path(path_type=Path), default=None,
              help="also write report.{json,md,html}, the plot and junit.xml here")
@click.option("--nproc", type=click.IntRange(min=1), default=1,
              help="calibrate, quantize and evaluate (torch reference) data-parallel in this many processes on "
                   "this node (torchrun); "
                   "for several nodes run `torchrun ... -m llmc build RECIPE` (docs/distributed.md)")
def build(recipe: Path, cache_dir: Path | None, threads: int | None, overrides: tuple[str, ...],
          no_publish: bool, as_json: bool, junit: Path | None, report_dir: Path | None, nproc: int) -> None:
    """Plan, calibrate, quantize, export, evaluate, gate and publish RECIPE."""
    from llmc import distributed  # lazy: start-up: `llmc --help` loads just click and llmc.engines

    if nproc > 1 and not distributed.launched():
        _launch(nproc, _without_nproc(sys.argv[1:]))
        return
    if distributed.world_from_env().rank > 0:  # calibrates, quantizes and scores its share of windows; rank 0 reports
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.build import build_until
        from llmc.telemetry.progress import set_quiet
        from llmc.storage.store import Store

        set_quiet(True)
        _run(lambda: build_until(_load(recipe, overrides), Store.default(cache_dir), "gate", threads=threads))
        return

    def go():
        try:
            _build(recipe, cache_dir, threads, no_publish, as_json, junit, report_dir, overrides)
        except Exception as e:
            # a build that never reached its gates still tells CI why, as an error test case
            if junit is not None and not isinstance(e, (QualityGateError, PerformanceGateError)):
                # lazy: start-up: `llmc --help` loads just click and llmc.engines
                from llmc.eval.ci import junit_xml
                from llmc.storage.resource_errors import resource_kind
                from llmc.storage.store import atomic_write_text

                kind = (e.kind if isinstance(e, LlmcError)
                        else "resource exhausted" if resource_kind(e) else "internal error")
                atomic_write_text(junit, junit_xml(recipe.stem, [], error=(kind, f"{type(e).__name__}: {e}")))
            raise

    _run(go)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def _launch(nproc: int, argv: list[str]) -> None:
    """`llmc ARGV` as `nproc` torchrun ranks on this node; exits as the job did (llmc.distributed.launch_local)."""
    from llmc import distributed  # lazy: start-up: `llmc --help` loads just click and llmc.engines

    try:
        distributed.launch_local(nproc, argv)
    except LlmcError as e:
        _fail(e)
    except distributed.RankFailed as e:
        sys.exit(e.exit_code)  # the rank printed its own message
    except distributed.JobFailed as e:
        click.echo(f"llmc: internal error: {e.message}\n  fix: {e.fix}", err=True)
        sys.exit(INTERNAL_ERROR_EXIT_CODE)


def _build(recipe: Path, cache_dir: Path | None, threads: int | None, no_publish: bool, as_json: bool,
           junit: Path | None, report_dir: Path | None, overrides: tuple[str, ...] = ()) -> None:
    # lazy: start-up: `llmc --help` loads just click and llmc.engines
    from llmc.build import build as run_build
    from llmc.pipeline.gate import raise_for_gates
    from llmc.eval.report import render_summary, report_dict
    from llmc.eval.ci import junit_xml
    from llmc.publish.outputs import write_build_outputs, write_report_files
    from llmc.storage.store import Store, atomic_write_text

    store = Store.default(cache_dir)
    result = run_build(_load(recipe, overrides), store, publish=not no_publish, threads=threads, overrides=overrides)
    out_dir = write_build_outputs(result, store)
    if report_dir is not None:
        write_report_files(result, report_dir)
    if junit is not None:
        atomic_write_text(junit, junit_xml(result.recipe.name, result.verdicts))
    if as_json:
        click.echo(json.dumps(report_dict(result), indent=2, default=str))
    else:
        click.echo(render_summary(result))  # the table, its footnotes and the gates' state
        cached = sum(s.cached for s in result.stages)
        click.echo(f"\nstages: {len(result.stages)} ({cached} cached); report: {out_dir / 'report.md'}")
        for label, art in result.artifacts.items():
            click.echo(f"artifact {label}: {art.dir}")
        if result.published:
            click.echo(f"published: {_relative(result.published)}" + (" (already there; no-op)" if result.publish_noop else ""))
    raise_for_gates(result)


@main.command(epilog=EXIT_HELP)
@reprobe_option
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@set_option
@resume_every_option
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="also estimate data-parallel calibration over this many processes (per rank, per layer)")
@click.option("--json", "as_json", is_flag=True,
              help="print the plan as JSON: every stage's row, with the decision it costs and the build executes")
@click.option("--machine", "machine", default=None, metavar="FILE_OR_PROFILE",
              help="plan for another machine, probing nothing here: a machine file `llmc probe` wrote there, or a "
                   "spec-sheet profile (an estimate) with its GPU count: h100-sxm:8, h100-pcie, h200, b200, "
                   "a100-80gb, l40s")
def plan(recipe: Path, cache_dir: Path | None, overrides: tuple[str, ...], nproc: int | None, as_json: bool,
         machine: str | None) -> None:
    """Check RECIPE against the runtimes and the model; estimate memory, disk and time."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.planning import target
        from llmc.planning.plan import make_plan, plan_recipe
        from llmc.storage.store import Store

        planned_for = target.load(machine) if machine else None  # a bad file fails before anything is read
        r = _load(recipe, overrides)
        make_plan(r)  # the recipe and the targets first: no source is touched when they fail
        with target.planning_for(planned_for):
            planned = plan_recipe(r, Store.default(cache_dir), recipe, nproc=nproc)
        if planned_for is not None:
            planned.basis = "; ".join(filter(None, [planned.basis, planned_for.describe()]))
        click.echo(json.dumps(planned.as_dict(), indent=2, default=str) if as_json else planned.render())

    _run(go)


@main.command(epilog=EXIT_HELP)
@reprobe_option
@click.argument("recipes", nargs=-1, type=click.Path(path_type=Path))
@cache_option
@click.option("--out", type=click.Path(path_type=Path), default=Path("llmc-machine.json"), show_default=True,
              help="the machine file to write")
def probe(recipes: tuple[Path, ...], cache_dir: Path | None, out: Path) -> None:
    """Measure this machine's rates and write them as a machine file for `llmc plan --machine FILE` elsewhere.

    Measures the compute probes the plans run (matmul per dtype on the CPU and each GPU kind, the quantizer),
    hashing, the disk's write+fsync and uncached read, memory and the GPUs; with RECIPES, also exactly the probes
    their plans read. Cached rates of this machine are reused (--reprobe measures them again)."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.planning.plan import make_plan, plan_recipe
        from llmc.planning import probes, target
        from llmc.planning.machine import memory_available
        from llmc.storage.store import Store

        store = Store.default(cache_dir)
        probes.use_cache(store.root)
        _measure_standard()
        for path in recipes:
            r = _load(path)
            make_plan(r)
            plan_recipe(r, store, path)
        rates = {k: list(p.samples) for k, p in probes.book().probes.items()}
        target.write(out, target.this_machine(rates, memory_available()))
        click.echo(f"wrote {len(rates)} rates to {target.load(str(out)).describe()}; plan for it elsewhere with "
                   f"`llmc plan RECIPE --machine {out}`")

    _run(go)


def _measure_standard() -> None:
    """The probes every plan may read, at the sizes they are read at: matmuls per dtype (on the CPU up the bounded
    ladder of widths, llmc.planning.machine; on a GPU at three widths), the quantizer at FP8 per-tensor and INT4
    per-group on each device, FP8 fake quantization and the stream's own per-layer work on the CPU, an export's
    config check (a Llama's meta skeleton at two depths: llmc.formats.described), an evaluation's scoring of the
    logits (llmc.engines.agreement), hashing, the
    store's large write and the disk's write+fsync and uncached read. A plan for this machine elsewhere reads other
    sizes and specs of the same probe from them (llmc.planning.target)."""
    # lazy: start-up: `llmc --help` loads just click and llmc.engines
    import torch
    from llmc.planning import disk, machine
    from llmc.quant.numerics import fake_quantize_rate, quantize_rate
    from llmc.quant.spec import TensorSpec
    from llmc.quant.stream_probe import PROBE_CONFIG, layer_overhead_seconds
    from llmc.formats.described import check_seconds
    from llmc.engines.agreement import scoring_rate

    for dtype in ("float32", "bfloat16"):
        for rows in (128, 512):
            machine.matmul_rate(dtype, "cpu", 8192, rows)
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda:0")
        for dtype in ("bfloat16", "float16", "float32"):
            for width in (1024, 4096, 8192):
                machine.matmul_rate(dtype, "cuda:0", width, machine.GPU_PROBE_ROWS)
    for device in devices:
        for dtype in ("float32", "bfloat16"):
            for spec in (TensorSpec("fp8_e4m3", "tensor"), TensorSpec("int4", "group", group_size=128)):
                quantize_rate(spec, dtype, device=device)
    for dtype in ("float32", "bfloat16"):
        fake_quantize_rate(TensorSpec("fp8_e4m3", "tensor"), dtype, width=4096, rows=512)
        for calibrated in (True, False):  # the stream's own per-layer work on a CPU
            layer_overhead_seconds(calibrated, dtype)
    check_seconds(PROBE_CONFIG)  # an export's config check, on a Llama's skeleton (other families: its class)
    for device in devices:  # an evaluation's scoring of the logits, per element (at Llama-3's vocabulary)
        for reference in (False, True):
            scoring_rate(128256, 256, reference, device)
    machine.hash_rate()
    machine.write_rate()
    disk.write_rate()
    disk.read_rate()


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@threads_option
@set_option
@resume_every_option
def quantize(recipe: Path, cache_dir: Path | None, threads: int | None, overrides: tuple[str, ...]) -> None:
    """Calibrate and quantize RECIPE's model into the canonical quantized form; print its path."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.build import build_until
        from llmc.storage.store import Store

        result = build_until(_load(recipe, overrides), Store.default(cache_dir), "quantize", threads=threads)
        from llmc.distributed import world_from_env  # lazy: start-up: `llmc --help` loads just click and llmc.engines

        if world_from_env().rank > 0:  # under torchrun rank 0 prints
            return
        for name, path in result.quantized_dirs.items():
            click.echo(f"{name}\t{path}" if name else str(path))

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@threads_option
@set_option
def export(recipe: Path, cache_dir: Path | None, threads: int | None, overrides: tuple[str, ...]) -> None:
    """Quantize (cached) and export every target of RECIPE; print each artifact's path."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.build import build_until
        from llmc.storage.store import Store

        result = build_until(_load(recipe, overrides), Store.default(cache_dir), "export", threads=threads)
        for label, art in result.artifacts.items():
            click.echo(f"{label}\t{art.dir}")

    _run(go)


@main.command(name="eval", epilog=EXIT_HELP)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--baseline", required=True, help="model source of the baseline (demo:..., folder or .gguf)")
@click.option("--engine", type=click.Choice(ENGINE_NAMES), default="torch",
              help="engines that cannot load the baseline model compare with the torch reference's")
@click.option("--windows", type=int, default=16)
@click.option("--seq-len", type=int, default=512)
@click.option("--corpus", "corpus", multiple=True,
              help="data source to evaluate on, as eval.corpus (docs/data.md): brown (default), hf:<id>, a .txt "
              "file or folder, or a mapping such as '{kind: jsonl, path: x.jsonl, field: text}'; repeat for several")
@click.option("--max-ppl-increase-pct", type=float, default=None, help="quality gate (upper 95%% bound)")
@click.option("--max-mean-kld", type=float, default=None, help="quality gate on KL(baseline||artifact) (upper bound)")
@click.option("--min-top1-agreement-pct", type=float, default=None, help="quality gate (lower 95%% bound)")
@cache_option
@threads_option
def eval_cmd(artifact: Path, baseline: str, engine: str, windows: int, seq_len: int, corpus: tuple[str, ...],
             max_ppl_increase_pct: float | None, max_mean_kld: float | None, min_top1_agreement_pct: float | None,
             cache_dir: Path | None, threads: int | None) -> None:
    """Evaluate an existing ARTIFACT (folder or registry entry) against a baseline, without rebuilding."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.eval.standalone import evaluate_artifact
        from llmc.storage.store import Store

        text, failed = evaluate_artifact(artifact, baseline, Store.default(cache_dir), engine=engine,
                                         windows=windows, seq_len=seq_len, corpus=corpus,
                                         max_ppl_increase_pct=max_ppl_increase_pct, max_mean_kld=max_mean_kld,
                                         min_top1_agreement_pct=min_top1_agreement_pct, threads=threads)
        click.echo(text)
        if failed:
            raise QualityGateError(failed)

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@set_option
def publish(recipe: Path, cache_dir: Path | None, overrides: tuple[str, ...]) -> None:
    """Publish RECIPE's build (every stage from cache when already built) into its registry."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.build import build as run_build
        from llmc.pipeline.gate import raise_for_gates
        from llmc.storage.store import Store

        result = run_build(_load(recipe, overrides), Store.default(cache_dir), publish=True, overrides=overrides)
        raise_for_gates(result)
        click.echo(f"{result.published}" + (" (already published; no-op)" if result.publish_noop else ""))

    _run(go)


def _raise_if_modified(path: Path, problems: list[str]) -> None:
    if problems:
        raise InputError(f"{path}: {len(problems)} difference(s) from its record: {'; '.join(problems[:4])}",
                         fix="publish the recipe again (llmc publish RECIPE repairs the entry), or rebuild the stage")


@main.command(epilog=EXIT_HELP)
@click.argument("path", type=click.Path(path_type=Path))
def inspect(path: Path) -> None:
    """Say what PATH is (artifact, quantized form, registry entry) and which runtimes accept it; a registry entry
    or cached stage output is also verified byte for byte (non-zero exit on any difference)."""

    def go():
        from llmc.publish.inspect import inspect_path  # lazy: start-up: `llmc --help` loads just click and llmc.engines

        text, problems = inspect_path(path)
        click.echo(text)
        _raise_if_modified(path, problems)

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--require-signature", is_flag=True,
              help="also fail when a registry entry is unsigned or its signature cannot be checked (no key set)")
def verify(path: Path, require_signature: bool) -> None:
    """Verify a registry entry (files against manifest.json, and manifest.sig when LLMC_SIGNING_KEY or
    LLMC_SIGNING_KEY_FILE is set) or a cached stage output; non-zero exit on any difference."""

    def go():
        from llmc.publish.inspect import verify_path  # lazy: start-up: `llmc --help` loads just click and llmc.engines

        text, problems = verify_path(path, require_signature=require_signature)
        click.echo(text)
        _raise_if_modified(path, problems)

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("entry")
@cache_option
@click.option("--html", "as_html", is_flag=True, help="print the path of report.html instead")
def report(entry: str, cache_dir: Path | None, as_html: bool) -> None:
    """Reprint the report of a build in the cache (its build id, a prefix, or its folder under <cache>/builds) or
    of a registry entry (a folder whose manifest.json lists the report and whose report matches it). Any other
    path is refused."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.publish.report import report_file
        from llmc.storage.store import Store

        path = report_file(entry, Store.default(cache_dir).root, "report.html" if as_html else "report.md")
        click.echo(path if as_html else path.read_text())

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.option("--write", "write_to", type=click.Path(path_type=Path), help="write the markdown to this file")
def matrix(write_to: Path | None) -> None:
    """Print the compatibility matrix (format x runtime x GPU arch x version) the planner checks against."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.runtimes.matrix import render_matrix
        from llmc.storage.store import atomic_write_text

        text = render_matrix()
        if write_to:
            atomic_write_text(write_to, text)
            click.echo(f"wrote {write_to}")
        else:
            click.echo(text)

    _run(go)


# --------------------------------------------------------------------------- the registry hook (docs/registry-hook.md)

config_option = click.option("--config", "config_path", type=click.Path(path_type=Path), required=True,
                             help="the hook's YAML config (routes, state folder, MLflow URI)")


@main.group(epilog=EXIT_HELP)
def hook() -> None:
    """The registry hook: a new model version in MLflow (or the Hub) -> build, gate, register its variants."""


@hook.command(epilog=EXIT_HELP)
@config_option
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8808, show_default=True, help="0: any free port (printed)")
def serve(config_path: Path, host: str, port: int) -> None:
    """Receive webhook deliveries and build the queued jobs one at a time (secrets from the environment)."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.hook.config import load_hook_config
        from llmc.hook.server import serve as run_server

        run_server(load_hook_config(config_path), host, port, config_path.resolve())

    _run(go)


@hook.command(name="status", epilog=EXIT_HELP)
@config_option
@click.option("--json", "as_json", is_flag=True)
def hook_status(config_path: Path, as_json: bool) -> None:
    """The hook's queue: every job, its state, its registrations or error."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.hook.commands import render_status, status_rows
        from llmc.hook.config import load_hook_config

        jobs, worker = status_rows(load_hook_config(config_path))
        click.echo(json.dumps({"worker": worker, "jobs": jobs}, indent=2) if as_json else render_status(jobs, worker))

    _run(go)


@hook.command(name="webhook", epilog=EXIT_HELP)
@config_option
@click.option("--url", required=True, help="where MLflow reaches `llmc hook serve`, e.g. https://hook.example/webhooks/mlflow")
@click.option("--name", default="llmc-hook", show_default=True)
def hook_webhook(config_path: Path, url: str, name: str) -> None:
    """Register the MLflow webhook (model_version.created -> URL) with the secret from LLMC_HOOK_MLFLOW_SECRET."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.hook.commands import register_webhook
        from llmc.hook.config import load_hook_config

        click.echo(f"webhook {register_webhook(load_hook_config(config_path), url, name)}: model_version.created -> {url}")

    _run(go)


@hook.command(name="execute", epilog=EXIT_HELP)
@click.argument("job_id")
@config_option
def hook_execute(job_id: str, config_path: Path) -> None:
    """Build one queued job here: what a Slurm or Kubernetes job runs on its node (hook.runner: slurm/kubernetes)."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.hook.commands import execute, raise_for_jobs
        from llmc.hook.config import load_hook_config

        raise_for_jobs([execute(load_hook_config(config_path), job_id)])

    _run(go)


@hook.command(name="run", epilog=EXIT_HELP)
@click.argument("model_uri")
@config_option
@click.option("--recipe", "recipes", type=click.Path(path_type=Path), multiple=True,
              help="build these recipes instead of the config's routes")
def hook_run(model_uri: str, config_path: Path, recipes: tuple[Path, ...]) -> None:
    """Do for MODEL_URI (models:/<name>/<version> or hf:<org>/<name>@<rev>) what a webhook delivery would."""

    def go():
        # lazy: start-up: `llmc --help` loads just click and llmc.engines
        from llmc.hook.commands import raise_for_jobs, render_status, run_now
        from llmc.hook.config import load_hook_config

        jobs = run_now(load_hook_config(config_path), model_uri, list(recipes) or None, config_path.resolve())
        click.echo(render_status([{**j, "source": j["source"]["uri"]} for j in jobs], False).split("\n", 1)[-1])
        raise_for_jobs(jobs)

    _run(go)


if __name__ == "__main__":
    main()
