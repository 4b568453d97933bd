"""Offline evaluation of a diffusion LM over a prompt set (Parquet, JSON Lines, CSV, OpenAI batch), on Ray.

    blockray --input s3://bucket/prompts/ --output s3://bucket/out/     # the installed command
    blockray eval --input …                                             # the same
    # against a running cluster (token auth on: RAY_AUTH_MODE=token); jobs/ ships with --working-dir
    ray job submit --working-dir . -- python jobs/offline_eval.py --input s3://bucket/prompts/ --output s3://bucket/out/

Without RAY_ADDRESS / --address it starts a private local Ray. Prints Ray Data's
progress while it runs, then one summary (rows, errors, generated tokens, tokens/s,
wall time, exact match when the input has a reference column), also written as
summary.json beside the outputs.

Why here and not in jobs/: the wheel ships only the packages, and the installed
`blockray` command needs the job's argument parsing and main. The engine, sampling and
processor options are generated from their dataclasses (EngineConfig, SamplingParams,
DLLMProcessorConfig: a field's `metadata["help"]` is its help line, its default is
shown), so a new config field is a new flag with no second list to keep in sync.
"""
from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import enum
import json
import os
import sys
import time
import typing
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo (or site-packages) root
_IN_REPO = os.path.isdir(os.path.join(ROOT, "jobs"))
DEFAULT_MODEL = os.path.join(ROOT, "engine", "assets", "tiny-dllm")  # package data: also in the wheel
DEFAULT_INPUT = os.path.join(ROOT, "jobs", "data", "tiny_eval.parquet")  # repo only
DEFAULT_OUTPUT_ROOT = os.path.join(ROOT, "out", "offline_eval") if _IN_REPO else os.path.join("out", "blockray")
# Fields the job sets itself (nested configs, internal switches) or through its own flags.
_NOT_FLAGS = {"engine", "sampling", "resources_per_engine"}
# Defaults that differ from the dataclass's on the command line: (value, how --help shows it).
_CLI_DEFAULTS: Dict[str, Tuple[Any, str]] = {
    "model": (DEFAULT_MODEL, "the embedded tiny model, engine/assets/tiny-dllm"),
    "num_engines": (None, "GPUs in the cluster, else 2"),
    # unset: the model's blockray.json may give it (an engine field too), else 1
    "tensor_parallel_size": (None, "the model's blockray.json, else 1"),
}


# --- options generated from the config dataclasses ---------------------------------------

def _flag_kwargs(tp: Any) -> Optional[Dict[str, Any]]:
    """argparse kwargs for a field's type: bools (also Optional[bool]) as --x/--no-x,
    Literal and StrEnum as choices, sequences as nargs="+", scalars by type; None when a
    field has no command-line form (dicts, nested dataclasses)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if set(rest) == {bool, int}:  # vLLM's logprobs (true or a count): a count on the command line
            rest = [int]
        if len(rest) != 1:
            return None
        tp, args = rest[0], typing.get_args(rest[0])
    origin = typing.get_origin(tp)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is typing.Literal:
        return {"choices": list(args), "type": type(args[0])}
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        return {"choices": [k.value for k in tp], "type": str}
    if origin in (list, tuple, collections.abc.Sequence) and args and args[0] in (int, float, str):
        return {"nargs": "+", "type": args[0]}
    if tp in (int, float, str):
        return {"type": tp}
    return None


def json_object(text: str) -> Dict[str, Any]:
    """A flag's JSON object (a dict field whose metadata says "json": chat_template_kwargs, ...)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r:.80}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r:.80}")
    return value


def _shown(value: Any, is_bool: bool = False) -> str:
    if is_bool:  # --x/--no-x; None lets the model or the data decide
        return {True: "on", False: "off", None: "auto"}[value]
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    return str(value)


def add_config_options(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup, cls: type, *,
                       dataclass_defaults: bool) -> None:
    """One flag per field of `cls` that has a command-line form and is not a flag already
    (a dict field whose metadata says "json": a JSON object).
    `dataclass_defaults=False`: the flag defaults to None (so that a model's blockray.json
    can fill it) and --help shows the dataclass's default."""
    hints = typing.get_type_hints(cls)
    taken = {s for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"type": json_object, "metavar": "JSON"} if f.metadata.get("json") else _flag_kwargs(hints[f.name])
        if f.name in _NOT_FLAGS or kwargs is None or flag in taken or f.metadata.get("cli") is False:
            continue
        if f.metadata.get("choices"):
            kwargs["choices"] = list(f.metadata["choices"])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = None
        is_bool = kwargs.get("action") is argparse.BooleanOptionalAction
        value, text = _CLI_DEFAULTS.get(f.name, (default, _shown(default, is_bool)))
        help_ = f.metadata.get("help") or f.name.replace("_", " ")
        group.add_argument(flag, dest=f.name, default=value if dataclass_defaults else None,
                           help=f"{help_} (default: {text})".replace("%", "%%"), **kwargs)


# --- the job's own options ------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse's parser whose refusals read as every refusal of the job: one `error: …`
    line on stderr, exit 2 (its usage text is --help's)."""

    def error(self, message: str) -> "typing.NoReturn":
        self.exit(2, f"error: {message} (see --help)\n")


def option_bounds() -> Dict[str, Any]:
    """Every numeric option's Bounds by its name: the config dataclasses' field metadata
    ("bounds") and the job's own options' (config.JOB_BOUNDS), declared there once."""
    from engine.config import EngineConfig, SamplingParams

    from .config import JOB_BOUNDS, DLLMProcessorConfig

    out = dict(JOB_BOUNDS)
    for cls in (DLLMProcessorConfig, EngineConfig, SamplingParams):
        out.update({f.name: f.metadata["bounds"] for f in dataclasses.fields(cls) if "bounds" in f.metadata})
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options, each numeric one within its bounds (`option_bounds`): a value outside
    them is refused here, naming the flag, before anything runs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:  # `blockray eval …` reads like the other tools' subcommands
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    bounds = option_bounds()
    for action in parser._actions:
        if action.dest in bounds and action.option_strings:
            err = bounds[action.dest].error(action.option_strings[0], getattr(args, action.dest))
            if err:
                parser.error(err)
    return args


def build_parser() -> argparse.ArgumentParser:
    from engine.config import EngineConfig, SamplingParams

    from .config import DLLMProcessorConfig
    from .dashboard import COST, DASHBOARD_PORT, DEFAULT_ON
    from .reader import INPUT_FORMATS
    from .writer import OUTPUT_FORMATS

    p = _Parser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("data")
    has_default_input = os.path.isfile(DEFAULT_INPUT)
    io.add_argument("--input", nargs="+", default=[DEFAULT_INPUT] if has_default_input else None,
                    required=not has_default_input,
                    help="prompt file(s)/folder(s) (--input-format): local path, s3://, any fsspec URL (default: "
                         + ("jobs/data/tiny_eval.parquet, 1,200 tiny-task prompts)" if has_default_input else "none)"))
    io.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                    help="parquet; jsonl (JSON Lines) and csv, with the same columns; openai-batch (OpenAI Batch / "
                         "vllm run-batch requests: {custom_id, method, url, body} per line, custom_id the ids; see "
                         "docs/formats.md); auto: by the files' suffix, a .jsonl whose first line has custom_id and "
                         "body being openai-batch (default: auto)")
    io.add_argument("--output-format", choices=OUTPUT_FORMATS, default="parquet",
                    help="part files as parquet or jsonl (JSON Lines), written as the run goes; openai-batch: Parquet "
                         "parts, then results.jsonl at --output when the run ends, one OpenAI batch result per "
                         "request in input order (default: parquet)")
    io.add_argument("--output", default=None,
                    help=f"output folder (local or s3://…) (default: {DEFAULT_OUTPUT_ROOT}/<time>)")
    io.add_argument("--overwrite", action="store_true", help="replace results already at --output (default: off)")
    io.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="keep results already at --output and process only the missing ids (default: on)")
    io.add_argument("--limit", type=int, default=None,
                    help="first N rows of the input, in file order; 0: none, a dry run (every check is made on the "
                         "first input file, the model and the output, and an empty summary.json written) "
                         "(default: all)")
    io.add_argument("--id-column", default=None,
                    help="the input's row ids, compared as strings by resume and the duplicate check; a column named "
                         "here must be in every input file (default: id when every input file has it; when none "
                         "has, each row's id is <file>:<row>, as the summary says)")
    io.add_argument("--reference-column", default="reference",
                    help="scored by exact match against generated_text when present (default: reference)")
    io.add_argument("--rows-per-file", type=int, default=256,
                    help="rows bundled per output file, 0: one file per batch (default: 256)")
    io.add_argument("--max-error-fraction", type=float, default=None,
                    help="share of rows that may fail (error rows) before the job exits non-zero; every row is "
                         "written either way; 1: never fail (default: 0, any failed row fails the job, as "
                         "ray.data.llm does by default)")
    io.add_argument("--resume-mismatch", choices=["refuse", "allow"], default="refuse",
                    help="resuming into an output written with other settings (model, adapter, engine or sampling "
                         "config, chat template, blockray version): refuse, naming what differs, or allow mixing "
                         "them (summary.json lists every run) (default: refuse)")
    io.add_argument("--allow-duplicate-ids", action="store_true",
                    help="generate every row even when ids repeat, and report them in summary.json "
                         "(default: off, refuse)")
    s3 = p.add_argument_group(
        "object storage (input, output and an s3:// --model)",
        "Credentials come from the cluster's environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN, AWS_PROFILE, instance roles), never from this command line: `ray job list` and the "
        "dashboard show a job's entrypoint (and its --runtime-env-json).")
    s3.add_argument("--endpoint-url", default=None,
                    help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS)")
    s3.add_argument("--region", default=None, help="S3 region (default: AWS_DEFAULT_REGION / AWS_REGION)")
    s3.add_argument("--access-key-id", default=None, help="S3 access key id, not a secret (default: AWS_ACCESS_KEY_ID)")
    # Refused (see run_job): kept only so that a caller still passing it gets a clear message.
    s3.add_argument("--secret-access-key", default=None, help=argparse.SUPPRESS)
    m = p.add_argument_group(
        "processor (DLLMProcessorConfig)",
        "--model: a local model directory, an object-storage URL (s3://bucket/prefix/, fetched once per node into "
        "$BLOCKRAY_MODEL_CACHE, default ~/.cache/blockray/models) or a hub id (huggingface_hub's cache).")
    m.add_argument("--engine-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="custom Ray resource each engine needs (repeatable), e.g. engine_slot=1 to place "
                        "engines on the nodes started with --resources '{\"engine_slot\": N}' (default: none)")
    add_config_options(p, m, DLLMProcessorConfig, dataclass_defaults=True)
    e = p.add_argument_group("engine (EngineConfig; defaults: the model's blockray.json, else the value shown)")
    add_config_options(p, e, EngineConfig, dataclass_defaults=False)
    d = p.add_argument_group("sampling (SamplingParams; defaults: the model's blockray.json, else the value shown)")
    add_config_options(p, d, SamplingParams, dataclass_defaults=False)
    from engine.presets import PRESETS
    d.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="named engine + sampling settings over the model's blockray.json, under the flags given: "
                        + "; ".join(f"{k}: {v.engine | v.sampling} ({v.source})" for k, v in PRESETS.items())
                        .replace("%", "%%") + " (default: none)")
    r = p.add_argument_group("ray")
    r.add_argument("--address", default=None, help="cluster to join (default: $RAY_ADDRESS, else start a local Ray)")
    r.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray (default: the machine's)")
    r.add_argument("--temp-dir", default=None, help="session folder of a local Ray (default: Ray's, /tmp/ray)")
    r.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=DEFAULT_ON,
                   help=f"start the Ray dashboard with a local Ray, on 127.0.0.1, and print its URL; with --address the "
                        f"cluster's dashboard is used (default: {'on' if DEFAULT_ON else 'off'}: {COST})")
    r.add_argument("--dashboard-port", type=int, default=DASHBOARD_PORT,
                   help=f"port of a local Ray's dashboard (default: {DASHBOARD_PORT})")
    io.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                    help="write report.html (plots of latency, blocks and steps to finish, tokens/s, engines, errors) "
                         "beside summary.json (default: on)")
    return p


def build_config(args: argparse.Namespace, num_gpus_in_cluster: float, storage: Any = None):
    """The processor config from the flags: engine and sampling fields from the model's
    blockray.json, overridden by the flags given; processor fields from their flags."""
    from engine.config import EngineConfig, SamplingParams

    from .config import MODEL_SETTINGS_FILE, DLLMProcessorConfig, model_settings, split_settings, unknown_settings
    from common.model_source import resolve_model

    revision = getattr(args, "revision", None)
    settings = model_settings(resolve_model(args.model, storage, weights=False, revision=revision))
    unknown = unknown_settings(settings)
    if unknown:  # else dropped silently: a typo would leave the model's defaults in place
        raise ValueError(f"{MODEL_SETTINGS_FILE} of model {args.model}: unknown key(s) {', '.join(unknown)}; it "
                         "takes the engine and sampling options' names (see --help)")
    eng_kw, smp_kw = split_settings(settings)
    if getattr(args, "preset", None):
        from engine.presets import get

        eng_kw.update(get(args.preset).engine)
        smp_kw.update(get(args.preset).sampling)
    for cls, kw in ((EngineConfig, eng_kw), (SamplingParams, smp_kw)):
        for f in dataclasses.fields(cls):
            if getattr(args, f.name, None) is not None:
                kw[f.name] = getattr(args, f.name)
    proc = {f.name: getattr(args, f.name) for f in dataclasses.fields(DLLMProcessorConfig)
            if f.name not in _NOT_FLAGS and hasattr(args, f.name)}
    if proc.get("tensor_parallel_size") is None:  # unset: EngineConfig's (blockray.json's, else 1) decides
        proc.pop("tensor_parallel_size", None)
    if args.num_engines is None:  # unset (never 0: refused as it is parsed)
        proc["num_engines"] = int(num_gpus_in_cluster) if num_gpus_in_cluster >= 1 else 2
    return DLLMProcessorConfig(**proc, engine=EngineConfig(**eng_kw), sampling=SamplingParams(**smp_kw),
                               resources_per_engine=parse_resources(args.engine_resource))


def parse_resources(items) -> "dict | None":
    """{"engine_slot": 1.0} from ["engine_slot=1"]; None when empty."""
    out = {}
    for item in items or []:
        name, sep, amount = item.partition("=")
        try:
            out[name.strip()] = float(amount) if sep else 1.0
        except ValueError:
            raise ValueError(f"--engine-resource {item!r}: expected NAME=AMOUNT") from None
        if not name.strip() or out[name.strip()] <= 0:
            raise ValueError(f"--engine-resource {item!r}: expected NAME=AMOUNT with AMOUNT > 0")
    return out or None


def build_spec(args: argparse.Namespace, num_gpus_in_cluster: float, run_id: str = ""):
    """The run the flags ask for (pipeline/run_spec.RunSpec), its processor config built
    here, once, against a cluster with `num_gpus_in_cluster` GPUs (the one the preflight
    checks it against); the storage options and --chat-template read once."""
    from common.storage import StorageOptions

    from .run_spec import MAX_ERROR_FRACTION, RunSpec

    storage = StorageOptions(endpoint_url=args.endpoint_url, region=args.region, key=args.access_key_id).resolved()
    return RunSpec(
        input=args.input if len(args.input) > 1 else args.input[0],
        output=args.output or os.path.join(DEFAULT_OUTPUT_ROOT, time.strftime("%Y%m%d-%H%M%S")),
        config=build_config(args, num_gpus_in_cluster, storage), storage=storage, limit=args.limit,
        id_column=args.id_column, reference_column=args.reference_column, overwrite=args.overwrite,
        resume=args.resume, rows_per_file=args.rows_per_file or None, allow_duplicate_ids=args.allow_duplicate_ids,
        max_error_fraction=MAX_ERROR_FRACTION if args.max_error_fraction is None else args.max_error_fraction,
        resume_mismatch=args.resume_mismatch, run_id=run_id, report=args.report, input_format=args.input_format,
        output_format=args.output_format)


# --- running it -------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None, runner: Optional[Callable[[argparse.Namespace], int]] = None) -> int:
    """Exit 0: every row generated (or fewer failed than --max-error-fraction); 2: the job
    could not run or failed, one line on stderr says why; 1: an internal error (a bug),
    whose traceback goes to a log file named on stderr. `runner`: run_job by default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # `blockray plan`: the memory plan per GPU count (pipeline.plan), no job
        from .plan import main as plan

        return plan(argv[1:])
    args = parse_args(argv)
    try:
        return (runner or run_job)(args)
    except Exception as e:  # noqa: BLE001 - a bug: one line here, the traceback in a file
        return report_internal_error(e)


def report_internal_error(e: BaseException) -> int:
    """Write the traceback of an unexpected error to a log file and name it on stderr."""
    import tempfile
    import traceback

    from common.storage import describe_error

    fd, path = tempfile.mkstemp(prefix=f"blockray-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        traceback.print_exception(e, file=f)
    print(f"internal error (a bug in blockray, please report it): {describe_error(e)}; traceback in {path}",
          file=sys.stderr, flush=True)
    return 1


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def run_job(args: argparse.Namespace) -> int:
    import ray

    from actors.metrics import new_run_id

    from .preflight import JobError, preflight
    from .resources import connected_cluster, local_cluster
    from .signals import Interrupted, StopOnSignal, stop_cleanly
    from common.storage import describe_error

    if args.secret_access_key is not None:  # never echo the value
        return fail("--secret-access-key is no longer accepted: a job's command line is shown by `ray job list` "
                    "and the dashboard. Give the cluster the credentials instead (AWS_SECRET_ACCESS_KEY and "
                    "AWS_ACCESS_KEY_ID in the nodes' environment, AWS_PROFILE with a credentials file on the "
                    "nodes, or an instance role).")
    run_id = new_run_id()
    print(f"blockray run {run_id} (the `run` tag of its metrics)", flush=True)
    job: Dict[str, Any] = {}  # what the clean stop on a signal releases
    stop = StopOnSignal(cleanup=lambda signum: stop_cleanly(job.get("checked")))
    stop.install()  # Ctrl-C / SIGTERM: a clean stop, exit 130 / 143 (pipeline/signals.py)
    address = args.address or os.environ.get("RAY_ADDRESS")
    ray_failed = ("Ray did not start: {}. Try again (a loaded node can time out while it starts), give it fewer CPUs "
                  "(--num-cpus), a short --temp-dir on a disk with free space, or join a running cluster (--address, "
                  "RAY_ADDRESS)")
    try:
        try:  # a joined cluster first: the engine pool is checked against it before the output is touched
            context = ray.init(address=address) if address else None
        except Exception as e:  # noqa: BLE001 - not a bug of blockray: say what to try
            return fail(ray_failed.format(describe_error(e)))
        try:  # fail fast, before a local Ray or any engine starts: bad options, input, output, model or pool
            cluster = connected_cluster() if address else local_cluster(args.num_cpus)
            checked = job["checked"] = preflight(build_spec(args, cluster.gpus, run_id), cluster=cluster)
        except (JobError, ValueError) as e:
            return fail(str(e))
        if checked.ids_note:
            print(f"ids: {checked.ids_note}", flush=True)
        from .dashboard import announce, local_ray_options

        if not address:  # address="local": never join a stale cluster left in /tmp/ray
            from .local_ray import start_local_ray

            try:
                context = start_local_ray(ray, num_cpus=args.num_cpus, _temp_dir=args.temp_dir,
                                          **local_ray_options(args.dashboard, args.dashboard_port),
                                          runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                                              [ROOT] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                        if x])}})
            except Exception as e:  # noqa: BLE001 - not a bug of blockray: say what to try
                return fail(ray_failed.format(describe_error(e)))
        announce(context, local=not address)
        return _run_on_ray(checked, stop)
    except Interrupted as e:
        stop_cleanly(job.get("checked"))
        return fail(f"interrupted ({e}): the part files already written are complete and kept; rerun with the "
                    "same --output to resume", e.exit_code)
    finally:
        stop.done.set()
        if job.get("checked") is not None:
            job["checked"].release()


def _run_on_ray(checked: Any, stop: Any) -> int:
    """The run the preflight checked (`checked.spec`, whose config is the one built from the
    flags), on the Ray this process is connected to."""
    import ray

    from .run import ErrorFractionExceeded, JobError, run_offline

    spec = checked.spec
    stop.install()  # again: ray.init replaces SIGTERM's handler with one that aborts
    try:
        config = spec.config
        print(f"blockray offline eval: run={spec.run_id} model={config.model} engines={config.num_engines} "
              f"engine={json.dumps(dataclasses.asdict(config.engine))} "
              f"sampling={json.dumps(dataclasses.asdict(config.sampling))}", flush=True)
        summary = run_offline(spec, preflighted=checked)
    except ErrorFractionExceeded as e:
        print_summary(e.summary)
        return fail(str(e))
    except JobError as e:  # the user's to fix (pipeline/failures.py); anything else is a bug: main's exit 1
        return fail(str(e))
    finally:
        ray.shutdown()
    print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    from .summary import format_summary

    print("\n=== summary ===")
    print(format_summary(summary))
    print("SUMMARY_JSON " + json.dumps({k: summary.get(k) for k in (
        "rows", "errors", "generated_tokens", "tokens_per_s", "wall_s", "exact_match", "rows_skipped",
        "rows_processed", "summary_file", "status", "top_errors", "duplicate_ids", "run_id", "report_file",
        "results_file")}), flush=True)


def entry_point() -> None:
    """The installed `blockray` command."""
    sys.exit(main())


__all__ = ["main", "parse_args", "build_parser", "build_config", "build_spec", "parse_resources", "run_job", "add_config_options", "entry_point"]
