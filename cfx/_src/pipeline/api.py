"""``cfx.pipeline``: the executor as a function, with the schedule tools attached to it.

``cfx.pipeline(model, schedule, axis="pipe")`` returns the per-rank train step (see
``executor.py``); ``cfx.pipeline.one_f_one_b(p, m)`` etc. build schedules as data,
``validate`` / ``simulate`` / ``grid`` / ``plot`` check, time and draw them, ``partition`` cuts a
model into stages and ``trace()`` records measured timelines of real steps.
"""
from cfx._src.pipeline.executor import PipelineStep, pipeline
from cfx._src.pipeline.partition import StagePlan, partition
from cfx._src.pipeline.render import grid, plot
from cfx._src.pipeline.schedule import Action, Schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from cfx._src.pipeline.simulate import Timeline, simulate
from cfx._src.pipeline.trace import PipelineTrace, trace
from cfx._src.pipeline.validate import ScheduleError, validate

pipeline.gpipe = gpipe
pipeline.one_f_one_b = one_f_one_b
pipeline.interleaved_1f1b = interleaved_1f1b
pipeline.zb_h1 = zb_h1
pipeline.validate = validate
pipeline.simulate = simulate
pipeline.grid = grid
pipeline.plot = plot
pipeline.partition = partition
pipeline.trace = trace
pipeline.ScheduleError = ScheduleError
pipeline.Schedule = Schedule
pipeline.Action = Action
pipeline.Timeline = Timeline
pipeline.StagePlan = StagePlan
pipeline.PipelineTrace = PipelineTrace
pipeline.PipelineStep = PipelineStep
