"""Offline evaluation of a diffusion LM over a Parquet prompt set, on Ray.

    # against a running cluster (token auth on: RAY_AUTH_MODE=token)
    ray job submit --working-dir . -- python jobs/offline_eval.py --input s3://bucket/prompts/ --output s3://bucket/out/
    # or directly (starts a local Ray unless RAY_ADDRESS / --address names a cluster)
    python jobs/offline_eval.py                      # embedded tiny model on jobs/data/tiny_eval.parquet

Prints Ray Data's progress while it runs, then one summary (rows, errors, generated
tokens, tokens/s, wall time, exact match when the input has a reference column), also
written as summary.json beside the outputs. All logic lives in pipeline/ (run_offline).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python jobs/offline_eval.py` puts jobs/, not the repo root, on sys.path
    sys.path.insert(0, ROOT)

DEFAULT_MODEL = os.path.join(ROOT, "engine", "assets", "tiny-dllm")
DEFAULT_INPUT = os.path.join(ROOT, "jobs", "data", "tiny_eval.parquet")
DEFAULT_OUTPUT_ROOT = os.path.join(ROOT, "out", "offline_eval")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    io = p.add_argument_group("data")
    io.add_argument("--input", nargs="+", default=[DEFAULT_INPUT], help="Parquet file(s)/folder(s): local path, s3://, any fsspec URL")
    io.add_argument("--output", default=None, help="output folder (local or s3://…); default out/offline_eval/<time>")
    io.add_argument("--overwrite", action="store_true", help="replace results already at --output")
    io.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="keep results already at --output and process only the missing ids (default on)")
    io.add_argument("--limit", type=int, default=None, help="first N rows of the input (file order)")
    io.add_argument("--id-column", default="id")
    io.add_argument("--prompt-column", default="prompt")
    io.add_argument("--messages-column", default="messages")
    io.add_argument("--reference-column", default="reference", help="scored by exact match when present")
    io.add_argument("--apply-chat-template", action="store_true", help="render --messages-column with the tokenizer's template")
    io.add_argument("--rows-per-file", type=int, default=256, help="rows bundled per output file (0: one file per batch)")
    io.add_argument("--max-error-fraction", type=float, default=None,
                    help="share of rows that may fail (error rows) before the job exits non-zero (default 0: any "
                         "failed row fails the job, as ray.data.llm does by default; every row is written either "
                         "way; 1: never)")
    io.add_argument("--allow-duplicate-ids", action="store_true",
                    help="generate every row even when ids repeat, and report them in summary.json (default: refuse)")
    s3 = p.add_argument_group(
        "object storage", "Credentials come from the cluster's environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, instance roles), never from this command "
        "line: `ray job list` and the dashboard show a job's entrypoint (and its --runtime-env-json).")
    s3.add_argument("--endpoint-url", default=None, help="default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL")
    s3.add_argument("--region", default=None, help="default: AWS_DEFAULT_REGION / AWS_REGION")
    s3.add_argument("--access-key-id", default=None, help="default: AWS_ACCESS_KEY_ID")
    # Refused (see main): kept only so that a caller still passing it gets a clear message.
    s3.add_argument("--secret-access-key", default=None, help=argparse.SUPPRESS)
    m = p.add_argument_group("model and engines")
    m.add_argument("--model", default=DEFAULT_MODEL, help="local HF-style model directory")
    m.add_argument("--num-engines", type=int, default=None, help="engine actors (default: GPUs in the cluster, else 2)")
    m.add_argument("--batch-size", type=int, default=16, help="rows per batch sent to an engine")
    m.add_argument("--max-concurrent-batches", type=int, default=4, help="batches in flight per engine")
    m.add_argument("--dtype", default="auto")
    m.add_argument("--num-cpus-per-engine", type=float, default=None)
    m.add_argument("--num-gpus-per-engine", type=float, default=None)
    m.add_argument("--engine-resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="custom Ray resource each engine needs (repeatable), e.g. engine_slot=1 to place "
                        "engines on the nodes started with --resources '{\"engine_slot\": N}'")
    m.add_argument("--sort", choices=["blendserve", "none"], default="blendserve",
                   help="blendserve: cost-balanced, length-ordered shard per engine (tokenizes the whole input "
                        "first); none: stream rows to whichever engine is free")
    m.add_argument("--sort-min-prefix", type=int, default=32,
                   help="blendserve: prompts sharing at least this many leading tokens stay on one engine, "
                        "adjacent (0: no prefix grouping)")
    e = p.add_argument_group("engine (default: the model's blockray.json, else EngineConfig's)")
    e.add_argument("--block-length", type=int)
    e.add_argument("--steps-per-block", type=int)
    e.add_argument("--cache", choices=["none", "refresh", "dual", "persistent"],
                   help="refresh: Fast-dLLM prefix cache; dual: Fast-dLLM dual cache (prefix and masked suffix)")
    e.add_argument("--canvas", choices=["auto", "block", "full"],
                   help="full: prompt + every masked block, as LLaDA's generate and Fast-dLLM decode (needed to "
                        "reproduce bidirectional models); block: BlockServe's box; auto (default): full for "
                        "bidirectional models, block for block-causal ones")
    e.add_argument("--token-budget", type=int)
    e.add_argument("--scheduler", choices=["blockserve", "static", "sequential"])
    e.add_argument("--max-batch-size", type=int)
    e.add_argument("--advance", choices=["block", "step"])
    d = p.add_argument_group("sampling (default: the model's blockray.json, else SamplingParams')")
    d.add_argument("--max-new-tokens", type=int)
    d.add_argument("--policy", choices=["fixed", "threshold", "factor", "timestep"],
                   help="fixed: LLaDA's schedule; threshold/factor: Fast-dLLM; timestep: Dream's schedule")
    d.add_argument("--remasking", choices=["low_confidence", "random", "entropy", "margin"],
                   help="the confidence that orders masked positions (random: LLaDA; entropy, margin: Dream)")
    d.add_argument("--first-position", action=argparse.BooleanOptionalAction, default=None,
                   help="Dream's block decoding: a block's first step commits only its first position "
                        "(default: on for Dream, off for LLaDA)")
    d.add_argument("--threshold", type=float)
    d.add_argument("--factor", type=float)
    d.add_argument("--temperature", type=float)
    d.add_argument("--top-p", type=float)
    d.add_argument("--top-k", type=int)
    d.add_argument("--stop", nargs="+", default=None, help="stop strings (the text is cut before the first)")
    d.add_argument("--seed", type=int)
    r = p.add_argument_group("ray")
    r.add_argument("--address", default=None, help="cluster to join (default: $RAY_ADDRESS, else start a local Ray)")
    r.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray")
    r.add_argument("--temp-dir", default=None, help="session folder of a local Ray (default Ray's /tmp/ray)")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, num_gpus_in_cluster: float):
    from pipeline.config import DLLMProcessorConfig, model_settings, split_settings
    from engine.config import EngineConfig, SamplingParams

    eng_kw, smp_kw = split_settings(model_settings(args.model))
    for f in dataclasses.fields(EngineConfig):
        if getattr(args, f.name, None) is not None:
            eng_kw[f.name] = getattr(args, f.name)
    for f in dataclasses.fields(SamplingParams):
        if getattr(args, f.name, None) is not None:
            smp_kw[f.name] = getattr(args, f.name)
    num_engines = args.num_engines or (int(num_gpus_in_cluster) if num_gpus_in_cluster >= 1 else 2)
    return DLLMProcessorConfig(
        model=args.model, num_engines=num_engines, batch_size=args.batch_size,
        max_concurrent_batches=args.max_concurrent_batches, engine=EngineConfig(**eng_kw),
        sampling=SamplingParams(**smp_kw), prompt_column=args.prompt_column, messages_column=args.messages_column,
        apply_chat_template=args.apply_chat_template, dtype=args.dtype,
        resources_per_engine=parse_resources(args.engine_resource),
        num_cpus_per_engine=args.num_cpus_per_engine, num_gpus_per_engine=args.num_gpus_per_engine, sort=args.sort,
        sort_min_prefix=args.sort_min_prefix)


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


def main(argv=None) -> int:
    """Exit 0: every row generated (or fewer failed than --max-error-fraction); 2: the job
    could not run or failed, one line on stderr says why; 1: an internal error (a bug),
    whose traceback goes to a log file named on stderr."""
    args = parse_args(argv)
    try:
        return run_job(args)
    except Exception as e:  # noqa: BLE001 - a bug: one line here, the traceback in a file
        return report_internal_error(e)


def report_internal_error(e: BaseException) -> int:
    """Write the traceback of an unexpected error to a log file and name it on stderr."""
    import tempfile
    import traceback

    from pipeline.storage import describe_error

    fd, path = tempfile.mkstemp(prefix=f"blockray-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        traceback.print_exception(e, file=f)
    print(f"internal error (a bug in blockray, please report it): {describe_error(e)}; traceback in {path}",
          file=sys.stderr, flush=True)
    return 1


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def run_job(args: argparse.Namespace) -> int:
    import ray

    from pipeline.run import MAX_ERROR_FRACTION, ErrorFractionExceeded, JobError, preflight, run_offline
    from pipeline.storage import StorageOptions

    if args.secret_access_key is not None:  # never echo the value
        return fail("--secret-access-key is no longer accepted: a job's command line is shown by `ray job list` "
                    "and the dashboard. Give the cluster the credentials instead (AWS_SECRET_ACCESS_KEY and "
                    "AWS_ACCESS_KEY_ID in the nodes' environment, AWS_PROFILE with a credentials file on the "
                    "nodes, or an instance role).")
    output = args.output or os.path.join(DEFAULT_OUTPUT_ROOT, time.strftime("%Y%m%d-%H%M%S"))
    storage = StorageOptions(endpoint_url=args.endpoint_url, region=args.region, key=args.access_key_id)
    job_input = args.input if len(args.input) > 1 else args.input[0]
    options = dict(storage=storage, limit=args.limit, id_column=args.id_column, overwrite=args.overwrite,
                   resume=args.resume, allow_duplicate_ids=args.allow_duplicate_ids,
                   max_error_fraction=MAX_ERROR_FRACTION if args.max_error_fraction is None
                   else args.max_error_fraction)
    try:  # fail fast, before Ray or any engine starts: bad options, input, output or model
        checked = preflight(job_input, output, build_config(args, 0), **options)
    except (JobError, ValueError) as e:
        return fail(str(e))
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # address="local": never join a stale cluster left in /tmp/ray
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _temp_dir=args.temp_dir,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     [ROOT] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])}})
    try:
        config = build_config(args, ray.cluster_resources().get("GPU", 0))
        print(f"blockray offline eval: model={args.model} engines={config.num_engines} "
              f"engine={dataclasses.asdict(config.engine)} sampling={dataclasses.asdict(config.sampling)}", flush=True)
        summary = run_offline(job_input, output, config, reference_column=args.reference_column,
                              rows_per_file=args.rows_per_file or None, preflighted=checked, **options)
    except ErrorFractionExceeded as e:
        print_summary(e.summary)
        return fail(str(e))
    except (JobError, ValueError) as e:
        return fail(str(e))
    finally:
        ray.shutdown()
    print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    from pipeline.summary import format_summary

    print("\n=== summary ===")
    print(format_summary(summary))
    print("SUMMARY_JSON " + json.dumps({k: summary[k] for k in ("rows", "errors", "generated_tokens", "tokens_per_s",
                                                              "wall_s", "exact_match", "rows_skipped",
                                                              "rows_processed", "summary_file", "status",
                                                              "top_errors", "duplicate_ids")}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
