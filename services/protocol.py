"""Every message that crosses a process boundary, as msgspec structs encoded with msgpack.

Nothing here is pickled. Each message carries a `schema` number; a reader that gets a
schema it does not know, bytes that do not decode, or a field of the wrong type sends the
entry to the job's dead stream with the decoder's reason (see `services.queues`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypeVar

import msgspec

from services.redis_values import Value, raw

SCHEMA = 1
MAX_MESSAGE_BYTES = 64 << 20


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A message sent on its own (not only inside another): it says the schema it was written in."""

    schema: int = SCHEMA


MessageT = TypeVar("MessageT", bound=Message)


class Task(Message, kw_only=True, forbid_unknown_fields=True):
    """Work for a rollout server: one context, `group_size` responses to it."""

    job_id: str
    task_id: int
    """Position in the job's dispatch order, unique within the job; the dispatcher's cursor."""
    example: int
    """Index of the example in the job's task dataset."""
    group_size: int
    dispatched_version: int
    """Learner version when the task was admitted."""


class Sample(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One trained sequence: a context and the policy's response(s), token by token."""

    sample_id: str
    """`{job}:{task_id}:{index}`: unique, so the learner can tell a duplicate delivery."""
    tokens: list[int]
    mask: list[int]
    """1 where the policy produced the token and it is trained, else 0."""
    logprobs: list[float]
    """Behaviour logprob of each token under the weights that sampled it (0 where mask=0)."""
    versions: list[int]
    """Weight version that produced each token; -1 for tokens the policy did not produce."""
    reward: float
    advantage: float
    num_turns: int
    metrics: dict[str, float] = {}
    """Task-specific scalars (success, asked, tokens...) averaged into the job's metrics."""
    reward_source: dict[str, str] = {}
    """What produced `reward`, so two runs' rewards are compared knowingly: `judge_model` and
    `simulator_model` as the upstreams named themselves in their replies, `rubric_sha256`
    (the judge's instructions as sent), `seed` (the job's sampling seed). Empty for a
    reward no LLM took part in."""


class TrajectoryGroup(Message, kw_only=True, forbid_unknown_fields=True):
    """All samples for one task: the unit the learner admits, filters and trains."""

    job_id: str
    task_id: int
    samples: list[Sample]
    server_id: str
    elapsed_s: float
    """Wall time from the task's arrival at the rollout server to this message."""
    dispatched_version: int = -1
    """The learner's version when it admitted the task (-1: not known)."""
    conversation: list[dict[str, str]] = []
    """Generate jobs: the conversation the best responses made (the SFT row)."""
    conversation_metrics: dict[str, float] = {}
    """Generate jobs: the task's metrics of that conversation, and `well_formed`."""
    responses: list[str] = []
    """Generate jobs: each sample's response text, in sample order."""

    def max_version(self) -> int:
        """Newest weight version behind any generated token (-1: none)."""
        return max((v for s in self.samples for v in s.versions), default=-1)

    def min_version(self) -> int | None:
        """Oldest weight version behind any trained token (None: nothing to train)."""
        return min((v for s in self.samples for v, m in zip(s.versions, s.mask) if m), default=None)

    def has_spread(self) -> bool:
        """Whether any advantage is non-zero: a group without spread adds nothing to the
        policy gradient (it is trained on nothing)."""
        return any(s.advantage != 0.0 for s in self.samples)


class EvalTask(Message, kw_only=True, forbid_unknown_fields=True):
    """One held-out conversation to play with the policy being trained (never trained on)."""

    job_id: str
    round: int
    """The evaluation it belongs to: the learner step (= policy version) that asked for it."""
    example: int
    """Index in the job's held-out task set (`services.held_out`)."""
    trial: int
    """Which play of the example this is (pass^k counts an example's trials)."""


class EvalResult(Message, kw_only=True, forbid_unknown_fields=True):
    """What one held-out conversation scored, for the learner to average into its round."""

    job_id: str
    round: int
    example: int
    trial: int
    server_id: str
    metrics: dict[str, float]
    """`success` (R_ext, 0 when malformed), `tokens`, `turns`, `well_formed`, the task's own
    metrics, the judge's score with the job's rubric (`judge`), tool use, and what its LLM
    calls cost (`judge_tokens`, `simulator_tokens`)."""
    versions: list[int]
    """The oldest and newest weight version behind its policy tokens ([] when none)."""
    elapsed_s: float
    conversation: list[dict[str, str]] = []
    """The conversation as played (role, content), for people to read."""


class RewardParts(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """R* of one conversation taken apart (`rollout.rewards.conversation`):
    reward = extrinsic_weight * r_ext - token_penalty + judge_weight * r_llm + tool_terms."""

    reward: float
    token_penalty: float
    """min(lambda * counted tokens, 1), subtracted."""
    r_ext: float | None = None
    """The task's metric in [0, 1]; None when not asked (weight 0, or an unfinished conversation)."""
    r_llm: float | None = None
    """The judge's score in [0, 1]; None when not asked."""
    tool_terms: float = 0.0
    """ARTIST's format and tool-execution terms."""
    verdict: str = ""
    """The judge's one-sentence reason for `r_llm`."""


class FutureView(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One forward-sampled future of a response, as scored."""

    messages: list[dict[str, str]]
    """What followed the response: the user simulator's and the policy's turns (role, content)."""
    parts: RewardParts
    malformed: str = ""
    """Why a later policy turn left the future unfinished ("" when it did not)."""


class ResponseView(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One sample of a training group, for people to read."""

    index: int
    messages: list[dict[str, str]]
    """What the policy wrote after the context: the response m_j (multiturn mode) or the whole
    conversation with the user's turns (episode mode)."""
    reward: float
    advantage: float
    malformed: str = ""
    """Why the format filter floored it ("" when well formed)."""
    parts: RewardParts | None = None
    """R* of the conversation itself, when it was scored as it stands (episode mode, window 0)."""
    futures: list[FutureView] = []
    """The futures behind its multiturn-aware reward (the mean of their R*)."""
    metrics: dict[str, float] = {}


class GroupView(Message, kw_only=True, forbid_unknown_fields=True):
    """A training group as text (`rollout.group_view`): what the job page's group browser
    reads from the job's capped `groups` stream. Never trained on; its texts are cut at
    `rollout.group_view.TEXT_CHARS`."""

    job_id: str
    task_id: int
    example: int
    server_id: str
    mode: str
    """`episode` or `multiturn` (`reward.mode`)."""
    dispatched_version: int
    versions: list[int]
    """The oldest and newest weight version behind its trained tokens ([] when none)."""
    weights: dict[str, float]
    """`extrinsic_weight` and `judge_weight`, to read `RewardParts` with."""
    context: list[dict[str, str]]
    responses: list[ResponseView]
    reward_source: dict[str, str] = {}


class TensorSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    """Checkpoint (Hugging Face) parameter name."""
    shape: list[int]
    dtype: str
    """torch dtype without the `torch.` prefix, e.g. `float32`."""
    offset: int
    """Byte offset inside the bucket."""
    nbytes: int


class Bucket(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    nbytes: int
    tensors: list[TensorSpec]


WeightBackend = Literal["gloo", "nccl"]
"""The process-group backend weights travel over (`weight_group.choose_backend`)."""


class WeightPlan(Message, kw_only=True, forbid_unknown_fields=True):
    """Announced once per update in `job:{id}:weights`; the broadcast follows."""

    job_id: str
    session: str
    """Identifies the learner process: a restarted learner counts epochs from 1 again."""
    version: int
    epoch: int
    """Group generation; a new epoch (new membership) means a new process group."""
    backend: WeightBackend
    store_host: str
    store_port: int
    world_size: int
    ranks: dict[str, int]
    """Rollout server id -> its rank in the weight group (the learner is rank 0)."""
    buckets: list[Bucket]
    timeout_s: float
    started: dict[str, float] = {}
    """Rollout server id -> the `ServerInfo.started` of the process the plan is for: a
    server restarted under the same id ignores a plan made for the process before it."""


class JobEvent(Message, kw_only=True, forbid_unknown_fields=True):
    """Published on `job:{id}:events`; subscribers also poll the keys, pub/sub is lossy."""

    kind: Literal["version", "stop"]
    version: int = 0


class WeightAck(Message, kw_only=True, forbid_unknown_fields=True):
    """A rollout server's word that it serves `version`; listed in `job:{id}:weights`."""

    server_id: str
    version: int
    epoch: int
    seconds: float


class ServerInfo(Message, kw_only=True, forbid_unknown_fields=True):
    """A rollout server's heartbeat in `rollout:servers`."""

    server_id: str
    heartbeat: float
    """Unix time of this record; the learner ignores servers silent for several periods."""
    job_id: str = ""
    """The job this server is serving ("" when idle)."""
    version: int = -1
    """Weight version it serves for that job; -1 until its first update."""
    capacity: int = 0
    inflight: int = 0
    engine: str = ""
    draining: bool = False
    """Leaving: it takes no new task and no new weight group; the learner leaves it out of
    plans from the moment it reads this."""
    started: float = 0.0
    """Unix time this server process started: a restarted server is a new member (one the
    learner evicted for never reaching the weight group gets another chance)."""
    waiting_on: str = ""
    """Why some of its episodes wait instead of failing: the judge proxy's reason for a
    model whose every upstream is down ("" when none waits). The learner pauses the job on it."""
    waiting_since: float = 0.0
    """Unix time the oldest of those waits began."""
    devices: list[str] = []
    """Its engine workers' devices (`weight_group.device_identity`: "cpu" or a GPU's UUID),
    once the engine is up: the learner picks the weight group's backend from them."""


_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_fleet(records: Mapping[Value, Value]) -> tuple[list[ServerInfo], list[str]]:
    """The rollout servers' records (`rollout:servers`) that decode, and the ids of those that
    do not: one record a server of another version (or anything else) wrote must not stop
    every reader of the fleet."""
    infos, unreadable = [], []
    for server_id, record in records.items():
        try:
            infos.append(decode(raw(record), ServerInfo))
        except (msgspec.DecodeError, ValueError):
            unreadable.append(raw(server_id).decode(errors="replace"))
    return infos, unreadable


def decode(data: bytes, kind: type[MessageT]) -> MessageT:
    """Decode and check the schema; raises `msgspec.DecodeError` / `ValueError` with the reason."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    message = msgspec.msgpack.decode(data, type=kind)
    if message.schema != SCHEMA:
        raise ValueError(f"unknown schema {message.schema}, this reader speaks {SCHEMA}")
    return message
