"""The Echo2 wire protocol: every request and response body, defined once and imported everywhere."""

from .common import (
    Backend,
    DesiredState,
    FieldError,
    JobStatus,
    LeaseStatus,
    Page,
    Problem,
    Role,
    RolloutStatus,
    WorkerStatus,
)
from .datasets import DatasetCreate, DatasetItems, DatasetRead
from .fleet import (
    Assignment,
    BadSource,
    Heartbeat,
    HeartbeatReply,
    ProviderCreate,
    ProviderCreated,
    ProviderRead,
    SamplingParams,
    WorkerRead,
    WorkerRegister,
    WorkerRegistered,
    WorkerStats,
)
from .jobs import (
    Device,
    GRPOConfig,
    JobCost,
    JobRead,
    JobSpec,
    LearnerResources,
    LossAggregation,
    PromptIn,
    PromptRead,
    TaskInfo,
    TaskSpec,
)
from .learner import (
    ClaimedGroup,
    FinishOutcome,
    LearnerBatch,
    LearnerClaim,
    LearnerFinish,
    LearnerHeartbeat,
    LearnerStartReply,
    LearnerTokenIssued,
    RolloutRewards,
    StepAck,
    StepReport,
)
from .metrics import StepMetrics
from .rollouts import (
    FinishReason,
    GroupResult,
    GroupSubmit,
    LeasedPrompt,
    LeaseRead,
    LeaseRequest,
    RolloutRead,
    RolloutSubmit,
    RolloutSubmitResult,
    SampleSubmit,
)
from .users import ApiKeyCreated, TokenKind, TokenRead, UserCreate, UserCreated, UserRead
from .weights import ChunkInfo, FileInfo, Manifest, VersionRead

__all__ = [name for name in dir() if not name.startswith("_")]
