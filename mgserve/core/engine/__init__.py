"""The engine: the actor, the scheduler, the scheduler-runner contract, the reference runner,
sampling, metrics."""
