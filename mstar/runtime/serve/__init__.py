"""The run loop stage: a plan, an engine and a workload in; finished requests, metrics, a step
timeline and benchmark figures out. The driver ties conductor, schedulers and engine together.
"""
