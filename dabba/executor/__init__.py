"""Where a step's model work runs: in this process (one rank), in local worker processes or on Ray
actors (tensor parallelism). The engine hands every executor the same SchedulerOutput and gets one
ModelRunnerOutput back."""
