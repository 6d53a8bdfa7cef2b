"""Stitching schedules: the schedule space of a fused pattern and its tuning by the
latency-evaluator (FusionStitching §4)."""
from .kernel_schedule import (SCHEMES, GroupSchedule, KernelSchedule, PartSchedule,
                              SharedBuffer)
from .tuner import ScheduleError, schedule_kernel

__all__ = ["SCHEMES", "GroupSchedule", "KernelSchedule", "PartSchedule", "SharedBuffer",
           "ScheduleError", "schedule_kernel"]
