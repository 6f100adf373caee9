"""``cfx.pipeline``: pipeline parallelism with schedules as data. The module is callable as the
executor: ``cfx.pipeline(model, schedule, axis="pipe")`` returns the per-rank train step;
``cfx.pipeline.one_f_one_b(p, m)`` (and ``gpipe``, ``interleaved_1f1b``, ``zb_h1``) build schedules
as per-rank action lists; ``validate`` / ``simulate`` / ``grid`` / ``plot`` check, time and draw
them; ``partition`` cuts a model into stages (a ``Partition``); ``trace()`` records measured
timelines of real steps.
"""
from cfx._src.core.modules import callable_module
from cfx._src.pipeline.executor import PipelineStep, pipeline
from cfx._src.pipeline.partition import Partition, partition
from cfx._src.pipeline.render import grid, plot
from cfx._src.pipeline.schedule import Action, Schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from cfx._src.pipeline.simulate import Timeline, simulate
from cfx._src.pipeline.trace import PipelineTrace, trace
from cfx._src.pipeline.validate import ScheduleError, validate

StagePlan = Partition  # its name until 0.2 (one class per name: cfx.parallel.Plan is the strategy)

__all__ = ["Action", "Partition", "PipelineStep", "PipelineTrace", "Schedule", "ScheduleError", "StagePlan", "Timeline",
           "gpipe", "grid", "interleaved_1f1b", "one_f_one_b", "partition", "pipeline", "plot", "simulate", "trace",
           "validate", "zb_h1"]

callable_module(__name__, pipeline)
