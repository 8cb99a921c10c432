"""The `llmc` command: parse, call the library, print. Exit codes: see `llmc --help` / README."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from llmc.engines import ENGINE_NAMES
from llmc.errors import EXIT_CODES, INTERNAL_ERROR_EXIT_CODE, LlmcError, PerformanceGateError, QualityGateError

EXIT_HELP = "Exit codes: " + ", ".join(f"{code} {kind}" for kind, code in sorted(EXIT_CODES.items(), key=lambda x: x[1]))


def _run(fn, *args, **kwargs):
    """Call into the library; turn LlmcError into its message and exit code."""
    try:
        return fn(*args, **kwargs)
    except LlmcError as e:
        click.echo(f"llmc: {e.kind}: {e.message}", err=True)
        if e.fix:
            click.echo(f"  fix: {e.fix}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("llmc: interrupted; finished stages are cached and a rerun resumes", err=True)
        sys.exit(130)
    except MemoryError:
        click.echo("llmc: resource exhausted: out of memory; finished stages are cached, rerun resumes", err=True)
        sys.exit(EXIT_CODES["resource exhausted"])
    except Exception as e:  # noqa: BLE001 - the one place that reports unexpected failures
        import traceback

        traceback.print_exc()
        click.echo(f"llmc: internal error: {type(e).__name__}: {e}", err=True)
        sys.exit(INTERNAL_ERROR_EXIT_CODE)


cache_option = click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
                            help="stage cache (default $LLMC_CACHE or ~/.cache/llmc)")
threads_option = click.option("--threads", type=int, default=None, help="torch CPU threads")


@click.group(epilog=EXIT_HELP)
@click.version_option(package_name="llmc")
@click.option("-q", "--quiet", is_flag=True, help="no progress output")
def main(quiet: bool) -> None:
    """Quantize a Hugging Face causal LM into evaluated, gated, runtime-ready artifacts."""
    from llmc.progress import set_quiet

    set_quiet(quiet)


def _load(recipe_path: Path):
    from llmc.recipe import load_recipe

    return load_recipe(recipe_path)


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@threads_option
@click.option("--no-publish", is_flag=True, help="stop after the gates")
@click.option("--json", "as_json", is_flag=True, help="print report.json instead of the table")
@click.option("--junit", type=click.Path(path_type=Path), default=None,
              help="also write JUnit XML here (one test case per gate; a crashed build is an error case)")
@click.option("--report-dir", type=click.Path(path_type=Path), default=None,
              help="also write report.{json,md,html}, the plot and junit.xml here")
def build(recipe: Path, cache_dir: Path | None, threads: int | None, no_publish: bool, as_json: bool,
          junit: Path | None, report_dir: Path | None) -> None:
    """Plan, calibrate, quantize, export, evaluate, gate and publish RECIPE."""

    def go():
        try:
            _build(recipe, cache_dir, threads, no_publish, as_json, junit, report_dir)
        except Exception as e:
            # a build that never reached its gates still tells CI why, as an error test case
            if junit is not None and not isinstance(e, (QualityGateError, PerformanceGateError)):
                from llmc.eval.ci import junit_xml
                from llmc.store import atomic_write_text

                kind = e.kind if isinstance(e, LlmcError) else "internal error"
                atomic_write_text(junit, junit_xml(recipe.stem, [], error=(kind, f"{type(e).__name__}: {e}")))
            raise

    _run(go)


def _build(recipe: Path, cache_dir: Path | None, threads: int | None, no_publish: bool, as_json: bool,
           junit: Path | None, report_dir: Path | None) -> None:
    from llmc.build import build as run_build
    from llmc.build import raise_for_gates
    from llmc.eval.report import render_summary, report_dict
    from llmc.eval.ci import junit_xml
    from llmc.registry.outputs import write_build_outputs, write_report_files
    from llmc.store import Store, atomic_write_text

    store = Store.default(cache_dir)
    result = run_build(_load(recipe), store, publish=not no_publish, threads=threads)
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
            click.echo(f"published: {result.published}" + (" (already there; no-op)" if result.publish_noop else ""))
    raise_for_gates(result)


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
def plan(recipe: Path, cache_dir: Path | None) -> None:
    """Check RECIPE against the runtimes and the model; estimate memory, disk and time."""

    def go():
        from llmc.model.source import resolve_source
        from llmc.plan import make_plan
        from llmc.store import Store

        r = _load(recipe)
        make_plan(r)
        store = Store.default(cache_dir)
        src = resolve_source(r.model.source, store, r.model.dtype)
        click.echo(make_plan(r, src.folder, store.root).render())

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@threads_option
def quantize(recipe: Path, cache_dir: Path | None, threads: int | None) -> None:
    """Calibrate and quantize RECIPE's model into the canonical quantized form; print its path."""

    def go():
        from llmc.build import build_until
        from llmc.store import Store

        result = build_until(_load(recipe), Store.default(cache_dir), "quantize", threads=threads)
        for name, path in result.quantized_dirs.items():
            click.echo(f"{name}\t{path}" if name else str(path))

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
@threads_option
def export(recipe: Path, cache_dir: Path | None, threads: int | None) -> None:
    """Quantize (cached) and export every target of RECIPE; print each artifact's path."""

    def go():
        from llmc.build import build_until
        from llmc.store import Store

        result = build_until(_load(recipe), Store.default(cache_dir), "export", threads=threads)
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
@click.option("--max-ppl-increase-pct", type=float, default=None, help="quality gate")
@cache_option
@threads_option
def eval_cmd(artifact: Path, baseline: str, engine: str, windows: int, seq_len: int,
             max_ppl_increase_pct: float | None, cache_dir: Path | None, threads: int | None) -> None:
    """Evaluate an existing ARTIFACT (folder or registry entry) against a baseline, without rebuilding."""

    def go():
        from llmc.eval.standalone import evaluate_artifact
        from llmc.store import Store

        text, failed = evaluate_artifact(artifact, baseline, Store.default(cache_dir), engine=engine,
                                         windows=windows, seq_len=seq_len,
                                         max_ppl_increase_pct=max_ppl_increase_pct, threads=threads)
        click.echo(text)
        if failed:
            from llmc.errors import QualityGateError

            raise QualityGateError(failed)

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("recipe", type=click.Path(path_type=Path))
@cache_option
def publish(recipe: Path, cache_dir: Path | None) -> None:
    """Publish RECIPE's build (every stage from cache when already built) into its registry."""

    def go():
        from llmc.build import build as run_build
        from llmc.build import raise_for_gates
        from llmc.store import Store

        result = run_build(_load(recipe), Store.default(cache_dir), publish=True)
        raise_for_gates(result)
        click.echo(f"{result.published}" + (" (already published; no-op)" if result.publish_noop else ""))

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("path", type=click.Path(path_type=Path))
def inspect(path: Path) -> None:
    """Say what PATH is (artifact, quantized form, registry entry) and which runtimes accept it."""

    def go():
        from llmc.registry.inspect import describe

        click.echo(describe(path))

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.argument("entry")
@cache_option
@click.option("--html", "as_html", is_flag=True, help="print the path of report.html instead")
def report(entry: str, cache_dir: Path | None, as_html: bool) -> None:
    """Reprint the report of a registry entry, a build directory, or a build id (prefix) in the cache."""

    def go():
        from llmc.errors import InputError
        from llmc.store import Store

        folder = Path(entry)
        if not (folder / "report.md").is_file():
            hits = sorted((Store.default(cache_dir).root / "builds").glob(f"{entry}*"))
            if len(hits) != 1:
                raise InputError(f"{entry} is not a registry entry or build directory, and matches "
                                 f"{len(hits)} build ids in the cache",
                                 fix="pass the entry's path or a longer build id")
            folder = hits[0]
        click.echo(folder / "report.html" if as_html else (folder / "report.md").read_text())

    _run(go)


@main.command(epilog=EXIT_HELP)
@click.option("--write", "write_to", type=click.Path(path_type=Path), help="write the markdown to this file")
def matrix(write_to: Path | None) -> None:
    """Print the compatibility matrix (format x runtime x GPU arch x version) the planner checks against."""

    def go():
        from llmc.targets.matrix import render_matrix
        from llmc.store import atomic_write_text

        text = render_matrix()
        if write_to:
            atomic_write_text(write_to, text)
            click.echo(f"wrote {write_to}")
        else:
            click.echo(text)

    _run(go)


if __name__ == "__main__":
    main()
