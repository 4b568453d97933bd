"""One job's settings, resolved once: `RunSpec`.

The CLI builds one from its flags (pipeline/cli.py), `run_offline` and `preflight` from a
Python caller's keywords when given no spec; the preflight, the processor, the run record
and the summary then read this one object. What is read from outside the arguments is
read here, once: the storage options' environment (AWS_*), the --chat-template file, and
the run's id. A job's numeric options are checked against their bounds (config.JOB_BOUNDS)
as it is built, so a spec that exists is one the preflight can start from.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from common.storage import StorageOptions

from .config import JOB_BOUNDS, DLLMProcessorConfig
from .errors import JobError

# Default share of rows that may fail before the job reports failure: none. Anchored on
# ray.data.llm, whose processors fail the job on the first failed row unless
# should_continue_on_error=True. Here the run still finishes and writes every row (the
# error rows say why), but the exit code tells the truth; --max-error-fraction 1.0 is
# should_continue_on_error=True.
MAX_ERROR_FRACTION = 0.0


class _Unread:
    """The type of UNREAD."""

    def __repr__(self) -> str:
        return "UNREAD"


# A chat template argument no one has read yet: the receiver reads config.chat_template
# itself (a library caller of build_processor); None means read, and none given.
UNREAD: Any = _Unread()


def check_options(**values: Any) -> None:
    """The job's own numeric options within their bounds (config.JOB_BOUNDS), else a
    JobError naming the first that is not."""
    for name, value in values.items():
        err = JOB_BOUNDS[name].error(name, value)
        if err:
            raise JobError(err, name)


def read_chat_template(value: Optional[str]) -> Optional[str]:
    """The Jinja text --chat-template names (pipeline/stages.resolve_chat_template), or a
    JobError naming the option when it is neither a file nor a template."""
    from . import stages  # looked up at call time: tests count the resolutions

    try:
        return stages.resolve_chat_template(value)
    except (OSError, ValueError) as e:
        raise JobError(str(e).removesuffix(" (--chat-template)"), "chat_template") from e


@dataclass(frozen=True)
class RunSpec:
    """What one offline run is asked to do: where prompts come from (`input`, one path or
    URL or a list; `input_format`), where results go (`output`, `output_format`,
    `rows_per_file`, `overwrite` / `resume` / `resume_mismatch`), the processor's config,
    object-storage options, which rows (`limit`, `id_column`, `allow_duplicate_ids`), how
    the run is judged (`max_error_fraction`, `reference_column`), whether report.html is
    written, and the `run_id` tagging its metrics and its lease (a fresh one when empty).

    Resolved as it is built: `storage` filled from the environment (every stage and engine
    then talks to the same endpoint), `chat_template` the text config.chat_template names
    (None when it names none); `dataclasses.replace` resolves the changed spec afresh."""

    input: Union[str, List[str]]
    output: str
    config: DLLMProcessorConfig
    storage: Optional[StorageOptions] = None
    limit: Optional[int] = None
    id_column: Optional[str] = None
    reference_column: Optional[str] = "reference"
    overwrite: bool = False
    resume: bool = True
    rows_per_file: Optional[int] = 256
    allow_duplicate_ids: bool = False
    max_error_fraction: float = MAX_ERROR_FRACTION
    resume_mismatch: str = "refuse"
    run_id: str = ""
    report: bool = False
    input_format: str = "auto"
    output_format: str = "parquet"
    chat_template: Optional[str] = dataclasses.field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, DLLMProcessorConfig):
            raise TypeError(f"RunSpec.config: a DLLMProcessorConfig, not {type(self.config).__name__}")
        check_options(limit=self.limit, max_error_fraction=self.max_error_fraction, rows_per_file=self.rows_per_file)
        set_ = object.__setattr__  # frozen: these are the spec's own, resolved once here
        set_(self, "storage", (self.storage or StorageOptions()).resolved())
        set_(self, "chat_template", read_chat_template(self.config.chat_template))
        if not self.run_id:  # the engines' `run` metrics tag, also in summary.json
            from actors.metrics import new_run_id

            set_(self, "run_id", new_run_id())

    @property
    def resumes(self) -> bool:
        """Whether ids already in the output are kept (resume, unless overwrite)."""
        return self.resume and not self.overwrite


def as_spec(spec: Union[RunSpec, str, List[str]], output: Optional[str], config: Optional[DLLMProcessorConfig],
            settings: Dict[str, Any]) -> RunSpec:
    """The RunSpec of a call given either one, or (input, output, config, **settings):
    the keywords RunSpec's fields take, as run_offline and preflight took them before."""
    if isinstance(spec, RunSpec):
        if output is not None or config is not None or settings:
            raise TypeError("give a RunSpec, or input, output, config and keywords, not both")
        return spec
    if output is None or config is None:
        raise TypeError("input, output and config are needed (or a RunSpec)")
    return RunSpec(spec, output, config, **settings)


__all__ = ["RunSpec", "as_spec", "check_options", "read_chat_template", "MAX_ERROR_FRACTION", "UNREAD"]
