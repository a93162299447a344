"""The `rldsl` command line.

check / plan / graph / explain import only the compiler (lark, networkx):
they must start fast; audit reads a run's journal, as light. run / report / export
import the runtime lazily.
Exit codes: 0 ok, 1 findings (errors, or warnings with --strict), 2 usage
error or unreadable file.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


def _color(args) -> bool:
    if getattr(args, "color", "auto") == "always":
        return True
    if getattr(args, "color", "auto") == "never" or os.environ.get("NO_COLOR"):
        return False
    return sys.stderr.isatty()


def _compile(path: str, want_plan: bool = True, overrides: list[str] | None = None):
    """The file compiled, with any `--set` overrides written into its source first."""
    from rldsl.compiler.driver import compile_file

    try:
        if overrides:
            return _compile_overridden(Path(path), want_plan, overrides)
        return compile_file(path, want_plan=want_plan)
    except FileNotFoundError:
        _usage_error(f"no such file: {path}", "check the path; pipelines live in pipelines/*.rlp")
    except IsADirectoryError:
        _usage_error(f"{path} is a directory", "give a .rlp file")
    except (OSError, UnicodeDecodeError) as err:
        _usage_error(f"cannot read {path}: {err}", "the file must be readable UTF-8 text")


def _compile_overridden(path: Path, want_plan: bool, overrides: list[str]):
    import dataclasses

    from rldsl.compiler.driver import compile_source
    from rldsl.compiler.overrides import OverrideError, apply_overrides

    try:
        text = apply_overrides(path.read_text(encoding="utf-8"), overrides)
    except OverrideError as err:
        _usage_error(str(err), "`rldsl plan FILE` lists the stages; blocks: run, staleness, buffer, placement, cluster")
    result = compile_source(text, str(path), base_dir=path.parent, want_plan=want_plan)
    if result.plan is not None:
        result.plan = dataclasses.replace(result.plan, overrides=list(overrides))
    return result


def _pipeline_files(paths: list[str]) -> list[str]:
    """``paths`` with each directory replaced by the `.rlp` files under it, sorted."""
    files = []
    for path in paths:
        if not Path(path).is_dir():
            files.append(path)
            continue
        found = sorted(str(p) for p in Path(path).rglob("*.rlp") if p.is_file())
        if not found:
            _usage_error(f"{path} holds no .rlp file", "give a .rlp file, or a directory with some under it")
        files += found
    return files


def _usage_error(message: str, help_text: str | None = None):
    print(f"error: {message}", file=sys.stderr)
    if help_text:
        print(f"  = help: {help_text}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _print_diagnostics(result, args) -> None:
    from rldsl.compiler.diagnostics import render_text

    if result.diagnostics:
        sys.stderr.write(render_text(result.diagnostics, result.source, result.filename, color=_color(args),
                                     verbose=getattr(args, "verbose", False)))
        _note_overrides(args)


def _note_overrides(args) -> None:
    if getattr(args, "overrides", None):
        print("note: checked with " + " ".join(f"--set {o}" for o in args.overrides) + " written into the file",
              file=sys.stderr)


def _exit_code(result, strict: bool) -> int:
    if not result.ok or (strict and result.diagnostics):
        return EXIT_FINDINGS
    return EXIT_OK


# ---------------------------------------------------------------- commands


def cmd_check(args) -> int:
    import json

    from rldsl.compiler.diagnostics import render_text, to_json, to_sarif

    results = [_compile(path, want_plan=False, overrides=args.overrides) for path in _pipeline_files(args.files)]
    if args.format == "json":
        payload = [to_json(r.diagnostics, r.filename) for r in results]
        print(json.dumps(payload[0] if len(payload) == 1 else payload, indent=2))
    elif args.format == "sarif":
        from rldsl.compiler.rules.catalog import RULES

        sarif = to_sarif([d for r in results for d in r.diagnostics], results[0].filename,
                         {c: r.summary for c, r in RULES.items()})
        if len(results) > 1:  # one run, results from every file
            sarif["runs"][0]["results"] = [res for r in results for res in to_sarif(
                r.diagnostics, r.filename, {})["runs"][0]["results"]]
        print(json.dumps(sarif, indent=2))
    else:
        for r in results:
            if r.diagnostics:
                sys.stderr.write(render_text(r.diagnostics, r.source, r.filename, color=_color(args),
                                             verbose=args.verbose))
                _note_overrides(args)
            else:
                print(f"{r.filename}: ok")
    return max(_exit_code(r, args.strict) for r in results)


def cmd_fmt(args) -> int:
    """Rewrite files to the current language (renamed settings, old meanings, regular layout);
    without --fix, show what would change and exit 1 if anything would."""
    import difflib

    from rldsl.compiler.fmt import format_source_by_code

    changed, files = 0, _pipeline_files(args.files)
    for path in files:
        result = _compile(path, want_plan=False)
        if result.program is None:  # a syntax error: nothing can be rewritten safely
            _print_diagnostics(result, args)
            return EXIT_FINDINGS
        text, applied = format_source_by_code(result.source, result.diagnostics)
        if text == result.source:
            continue
        changed += 1
        if args.fix:
            Path(path).write_text(text)
            print(f"formatted: {path}{_rewritten(applied)}")
        else:
            sys.stdout.writelines(difflib.unified_diff(result.source.splitlines(keepends=True),
                                                       text.splitlines(keepends=True), path, f"{path} (formatted)"))
    if changed and not args.fix:
        print(f"{changed} file(s) would change; `rldsl fmt --fix` rewrites them", file=sys.stderr)
        return EXIT_FINDINGS
    unchanged = len(files) - changed
    if unchanged:
        print(f"{unchanged} file{'s' * (unchanged != 1)} already in the current language and layout")
    return EXIT_OK


def _rewritten(applied) -> str:
    """` (1 renamed setting, 2 old meanings written out)`: what `fmt --fix` changed besides the layout."""
    renamed, kept = applied.get("RLP109", 0), sum(applied.values()) - applied.get("RLP109", 0)
    parts = ([f"{renamed} renamed setting{'s' * (renamed != 1)}"] if renamed else []) + \
        ([f"{kept} old meaning{'s' * (kept != 1)} written out"] if kept else [])
    return f" ({', '.join(parts)})" if parts else ""


def cmd_plan(args) -> int:
    from rldsl.compiler.plan_view import render_plan

    result = _compile(args.file, overrides=args.overrides)
    _print_diagnostics(result, args) if not result.ok else None
    if not result.ok:
        return EXIT_FINDINGS
    if args.out:
        Path(args.out).write_text(result.plan.to_json() + "\n")
    if args.format == "json":
        print(result.plan.to_json())
    else:
        sys.stdout.write(render_plan(result))
        if args.out:
            print(f"saved: {args.out} (run it with `rldsl run --plan {args.out}`)")
    return EXIT_OK


def cmd_graph(args) -> int:
    from rldsl.compiler.plan_view import render_graph

    result = _compile(args.file, overrides=args.overrides)
    if not result.ok:
        _print_diagnostics(result, args)
        return EXIT_FINDINGS
    sys.stdout.write(render_graph(result.plan, args.format))
    return EXIT_OK


def cmd_explain(args) -> int:
    from rldsl.compiler.rules.catalog import RETIRED, RULES

    code = args.code.upper()
    if code.isdigit():
        code = f"RLP{int(code):03d}"
    if code in RETIRED:
        print(f"{code} (retired): {RETIRED[code]}")
        return EXIT_OK
    rule = RULES.get(code)
    if rule is None:
        _usage_error(f"no rule {args.code}", "codes: " + ", ".join(RULES))
    print(f"{rule.code} ({rule.severity}): {rule.summary}\n\n{rule.explanation}\n\nExample:\n")
    print("\n".join(f"    {line}" for line in rule.example.splitlines()))
    print(f"\nReads: {rule.reads}")
    return EXIT_OK


def cmd_run(args) -> int:
    from rldsl.plan import ExecutionPlan, PlanFormatError

    if args.overrides and (args.plan or args.resume):
        _usage_error("--set changes a pipeline file; a saved plan (and a resumed run's) is run as it was made",
                     "give the file: `rldsl run FILE --set ...` (a resumed run keeps the overrides it started with)")
    if args.resume:  # the run's own saved plan: a resumed run executes exactly what it started with
        if not (Path(args.resume) / "plan.json").exists():
            _usage_error(f"{args.resume} is not a run directory (it has no plan.json)",
                         "pass the directory a previous `rldsl run` wrote, e.g. runs/grpo_async-...")
        args.plan = str(Path(args.resume) / "plan.json")
    if args.plan:
        try:
            plan = ExecutionPlan.from_json(Path(args.plan).read_text())
        except FileNotFoundError:
            _usage_error(f"no such plan: {args.plan}", "create one with `rldsl plan FILE --out plan.json`")
        except (PlanFormatError, ValueError, KeyError, TypeError) as err:
            _usage_error(f"{args.plan} is not a valid plan: {err}", "re-create it with `rldsl plan FILE --out`")
        if not _plan_passes_checks(plan, args.plan, show_warnings=not args.resume):
            return EXIT_FINDINGS
    elif args.file:
        result = _compile(args.file, overrides=args.overrides)
        _print_diagnostics(result, args)
        if not result.ok:
            return EXIT_FINDINGS
        plan = result.plan
    else:
        _usage_error("give a pipeline file or --plan", "rldsl run pipelines/grpo_async.rlp")
    try:
        from rldsl.runtime.ray_lowering.launch import run_plan
    except ImportError as err:
        _missing_extras(err)
    return run_plan(plan, args)


def _plan_passes_checks(plan, path: str, show_warnings: bool) -> bool:
    """A saved plan may be hand-edited: the rules a plan's numbers can break,
    again, before anything starts (compiler/plan_check.py)."""
    from rldsl.compiler.plan_check import check_plan, render_plan_findings

    try:
        findings = check_plan(plan)
    except (TypeError, ValueError, KeyError, AttributeError, StopIteration) as err:
        _usage_error(f"{path} is not a valid plan: {type(err).__name__}: {err}",
                     "re-create it with `rldsl plan FILE --out`")
    errors = any(f.is_error for f in findings)
    if errors or (findings and show_warnings):
        sys.stderr.write(render_plan_findings(findings, path))
    return not errors


def _grace(text: str) -> float:
    """`--grace`: seconds, or a duration as the language writes them (`45s`, `2m`)."""
    from rldsl.compiler.units import DURATION_UNITS

    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):] or "s"
    try:
        seconds = float(number) * DURATION_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 30s, 2m)") from None
    if not 1 <= seconds <= 24 * 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give between 1s and 24h")
    return seconds


def _missing_extras(err: ImportError):
    if err.name and err.name.split(".")[0] == "rldsl":
        raise err  # our own bug, not a missing install: let it show
    _usage_error(f"the runtime needs `{err.name}`, which is not installed",
                 "pip install -e '.[run,cpu]' (a GPU machine: '.[run,gpu]')")


def cmd_report(args) -> int:
    try:
        from rldsl.report import write_report
    except ImportError as err:
        _missing_extras(err)
    return write_report(Path(args.run_dir), html=args.html)


def cmd_audit(args) -> int:
    from rldsl.audit import audit_command

    return audit_command(Path(args.run_dir), args.format)


def cmd_export(args) -> int:
    try:
        from rldsl.runtime.export import export_command
    except ImportError as err:
        _missing_extras(err)
    return export_command(Path(args.run_dir), Path(args.out), version=args.version, force=args.force,
                          pipeline=args.pipeline, merge=args.merge)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rldsl", description="Checked pipelines for asynchronous RL post-training.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="colour diagnostics (auto: only on a terminal)")
    common.add_argument("--verbose", action="store_true",
                        help="show in full the findings another finding explains (folded under it by default)")
    settable = argparse.ArgumentParser(add_help=False)
    settable.add_argument("--set", action="append", default=[], dest="overrides", metavar="TARGET.KEY=VALUE",
                          help="change a setting as if the file said so (repeatable): `actor.lr=1e-5`, "
                               "`run.steps=100`")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", parents=[common, settable], help="prove a pipeline file sane")
    p.add_argument("files", nargs="+", metavar="FILE", help="pipeline files, or directories to check every .rlp under")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    p.add_argument("--strict", action="store_true", help="warnings fail too (exit 1)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("fmt", parents=[common], help="rewrite files to the current language (renamed settings, "
                                                     "old meanings, regular layout), comments kept")
    p.add_argument("files", nargs="+", metavar="FILE", help="pipeline files, or directories of them")
    p.add_argument("--fix", action="store_true", help="write the files (default: show the diff, exit 1 if any)")
    p.set_defaults(func=cmd_fmt)

    p = sub.add_parser("plan", parents=[common, settable], help="show where every rank of every stage lands")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--out", metavar="PLAN_JSON", help="save the plan for `rldsl run --plan`")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("graph", parents=[common, settable], help="the dataflow as a diagram")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("mermaid", "dot"), default="mermaid")
    p.set_defaults(func=cmd_graph)

    p = sub.add_parser("explain", parents=[common], help="the long explanation of a rule code")
    p.add_argument("code", metavar="CODE")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("run", parents=[common, settable], help="compile and run a pipeline on Ray")
    p.add_argument("file", nargs="?", metavar="FILE")
    p.add_argument("--plan", metavar="PLAN_JSON", help="run a saved plan exactly")
    p.add_argument("--steps", type=int, help="override the file's run.steps")
    p.add_argument("--run-dir", metavar="DIR", help="where metrics, checkpoints and summary.json go")
    p.add_argument("--address", metavar="ADDR", help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a previous run from its last checkpoint")
    p.add_argument("--dry-run", action="store_true",
                   help="reserve the placement groups, report where every actor would start, exit")
    p.add_argument("--grace", type=_grace, metavar="DURATION",
                   help="how long a stop (Ctrl-C, SIGTERM, SIGHUP) may take to checkpoint, write summary.json and "
                        "stop Ray: 30s by default, a scheduler's usual grace before SIGKILL")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", parents=[common], help="plot and summarise a finished run")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--html", action="store_true", help="also write report.html: the same, interactive, self-contained")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("audit", parents=[common], help="prove from a run's journal that every sample was accounted for")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("export", parents=[common], help="write a run's trained policy as a Hugging Face model")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (new, or empty)")
    p.add_argument("--version", type=int, metavar="V", help="the checkpoint of this version (default: the newest "
                                                            "complete one)")
    p.add_argument("--pipeline", metavar="NAME", help="which pipeline, for a run of several")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--merge", action="store_true", help="a LoRA run on a Hugging Face base: the model with the "
                                                        "adapters merged in (and the adapter in OUT/adapter), "
                                                        "not the adapter alone")
    p.set_defaults(func=cmd_export)
    return parser


# never a traceback, whatever the input
_CHECKED_COMMANDS = ("check", "plan", "graph", "explain", "audit", "fmt", "export")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `rldsl plan --format json | head`
        sys.stderr.close()
        return EXIT_OK
    except Exception as error:  # noqa: BLE001 - the top: anything left is a bug of ours
        if args.command not in _CHECKED_COMMANDS:
            raise
        return _internal_error(args, error)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _internal_error(args, error: Exception) -> int:
    """ruff's convention: an internal error is exit 2 and says so, in the
    format asked for; RLDSL_DEBUG=1 adds the traceback."""
    import json
    import traceback

    text = f"{type(error).__name__}: {error}"
    if getattr(args, "format", "text") in ("json", "sarif"):
        print(json.dumps({"internal_error": text, "valid": False}, indent=2))
    print(f"internal error: {text}", file=sys.stderr)
    print("  = note: this is a bug in rldsl, not in your file; please report it with the file that caused it",
          file=sys.stderr)
    if os.environ.get("RLDSL_DEBUG"):
        traceback.print_exc()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
