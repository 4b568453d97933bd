"""Offline evaluation of a diffusion LM over a Parquet prompt set, on Ray: what
`ray job submit` runs (the installed `blockray` command is the same job).

    ray job submit --working-dir . -- python jobs/offline_eval.py --input s3://bucket/prompts/ --output s3://bucket/out/
    python jobs/offline_eval.py                      # embedded tiny model on jobs/data/tiny_eval.parquet

A thin wrapper: the options and main live in pipeline/cli.py, so that the wheel's
`blockray` command has them too.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python jobs/offline_eval.py` puts jobs/, not the repo root, on sys.path
    sys.path.insert(0, ROOT)

from pipeline import cli  # noqa: E402
from pipeline.cli import (DEFAULT_INPUT, DEFAULT_MODEL, DEFAULT_OUTPUT_ROOT, build_config,  # noqa: E402,F401
                          parse_args, parse_resources, print_summary, report_internal_error, run_job)


def main(argv=None) -> int:
    """pipeline.cli.main, running this module's `run_job` (looked up at call time)."""
    return cli.main(argv, runner=lambda args: run_job(args))


if __name__ == "__main__":
    sys.exit(main())
