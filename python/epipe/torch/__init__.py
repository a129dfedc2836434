"""epipe.torch: a PyTorch front end shaped like torch.distributed.pipelining.

Wrap each pipeline stage's module in a PipelineStage, pick a schedule, call
step(): the schedule splits the batch into micro-batches, runs the stage's
op stream (forwards, backwards, split backwards) with torch autograd, and
moves compressed activations and gradients over the communicator. Shapes
travel in the messages, so no stage needs example inputs. docs/python.md.
"""
from ._schedule import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBH1,
    ScheduleZBV,
)
from ._ddp import CompressedAllreduceState, allreduce_gradients, compressed_allreduce_hook
from ._profile import Profile, codec_table, plan, profile
from ._split import split_sequential
from ._stage import PipelineStage

__all__ = [
    "PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
    "ScheduleInterleaved1F1B", "ScheduleZBH1", "ScheduleZBV", "split_sequential", "Profile",
    "codec_table", "plan", "profile", "CompressedAllreduceState", "allreduce_gradients",
    "compressed_allreduce_hook",
]
