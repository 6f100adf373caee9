"""Pipeline-parallel schedules as data: generators, a validator, a simulator and renderers."""
