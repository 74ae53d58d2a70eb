"""One configuration schema for every process: the job spec users submit and each
process's settings. Pydantic only, importable without torch or vLLM.

Bounds live in `Field(...)` so a bad value is rejected with the field's name (the API
turns that into a 422 that names the field, `job.written_location`). By module:
- `common`: strict validation and the bounds on names, paths and text;
- `sections`: the sections every kind of job shares (model, rollout, reward, train, ...);
- `tasks`: the `task` section, one model per task, picked by `name`;
- `tools`: the `tools` section, one model per tool kind, picked by `kind`;
- `job`: the job spec, one model per kind of job, picked by `kind`;
- `settings`: each process's settings from `TANDEM_*` variables.
Everything is importable from `services.config` itself.
"""

from services.config.common import JOB_NAME, MODEL_NAME_CHARS, PATH_CHARS, TEXT_CHARS, Strict
from services.config.job import (
    JOB_KINDS,
    KIND_NAMES,
    GenerateJob,
    JobSpec,
    OfflineJob,
    RLJob,
    file_fields,
    parse_job_spec,
    parse_job_spec_json,
    written_location,
)
from services.config.sections import (
    HEALTH_METRICS,
    BudgetSpec,
    EvalSpec,
    GenerateSpec,
    HealthRule,
    LossSpec,
    ModelSpec,
    RewardSpec,
    RolloutSpec,
    TrackingSpec,
    TrainSpec,
    WandbSpec,
    WarmStartSpec,
)
from services.config.settings import (
    JUDGE_OUTAGE_S,
    ApiSettings,
    JudgeProxySettings,
    LearnerSettings,
    RolloutSettings,
)
from services.config.tasks import (
    TASK_NAMES,
    TASK_SPECS,
    TAU2_DOMAINS,
    ChatTaskBase,
    ClarifySpec,
    CodeChatSpec,
    DeliverableTaskBase,
    DocEditChatSpec,
    FixtureTaskBase,
    GeneratedTaskBase,
    HeldOutTask,
    MathChatSpec,
    MultiplySpec,
    TaskBase,
    TaskSpec,
    Tau2Spec,
)
from services.config.tools import (
    TOOL_KINDS,
    CalculatorToolSpec,
    McpServerSpec,
    McpToolSpec,
    PythonToolSpec,
    SearchToolSpec,
    ToolBase,
    ToolCatalog,
    ToolSpec,
    ToolsSpec,
)

__all__ = [
    "HEALTH_METRICS",
    "JOB_KINDS",
    "JOB_NAME",
    "JUDGE_OUTAGE_S",
    "KIND_NAMES",
    "MODEL_NAME_CHARS",
    "PATH_CHARS",
    "TASK_NAMES",
    "TASK_SPECS",
    "TAU2_DOMAINS",
    "TEXT_CHARS",
    "TOOL_KINDS",
    "ApiSettings",
    "BudgetSpec",
    "CalculatorToolSpec",
    "ChatTaskBase",
    "ClarifySpec",
    "CodeChatSpec",
    "DeliverableTaskBase",
    "DocEditChatSpec",
    "FixtureTaskBase",
    "GeneratedTaskBase",
    "EvalSpec",
    "GenerateJob",
    "GenerateSpec",
    "HealthRule",
    "HeldOutTask",
    "JobSpec",
    "JudgeProxySettings",
    "LearnerSettings",
    "LossSpec",
    "MathChatSpec",
    "McpServerSpec",
    "McpToolSpec",
    "ModelSpec",
    "MultiplySpec",
    "OfflineJob",
    "PythonToolSpec",
    "RLJob",
    "RewardSpec",
    "RolloutSettings",
    "RolloutSpec",
    "SearchToolSpec",
    "Strict",
    "TaskBase",
    "TaskSpec",
    "Tau2Spec",
    "ToolBase",
    "ToolCatalog",
    "ToolSpec",
    "ToolsSpec",
    "TrackingSpec",
    "TrainSpec",
    "WandbSpec",
    "WarmStartSpec",
    "file_fields",
    "parse_job_spec",
    "parse_job_spec_json",
    "written_location",
]
