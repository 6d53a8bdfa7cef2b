"""What the planner may put in one kernel: codegen's own build rules read from the HLO layer
(``buildable``) and the stitchability of a pattern (``feasibility``: shared reductions and
their row partitions). Below the cost models, the schedules and the explorer, which all ask it."""
