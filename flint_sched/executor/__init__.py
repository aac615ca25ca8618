"""Executors turn a StepPlan into a StepResult: the torch path here, the CUDA path beside it."""
