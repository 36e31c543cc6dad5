from replica.scheduler.config import SchedulerConfig
from replica.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData, PinStats,
                                      RequestOutput, SchedulerOutput, SchedulerStats, SpecDecodingStats)
from replica.scheduler.scheduler import Scheduler

__all__ = [
    "CachedRequestData", "ModelRunnerOutput", "NewRequestData", "PinStats", "RequestOutput", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "SpecDecodingStats",
]
