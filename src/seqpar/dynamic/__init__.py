"""Length-aware sequence parallelism (`sequence_parallel: {size: dynamic, max_local_tokens: N}`), below every
trainer: each row runs at the SP degree its length needs, short rows packed per rank, the step's slots balanced
across ranks with the planner's cost model of a micro-batch (docs/training.md, "Length-aware SP").

    cost.py      RowCost: seconds of one micro-batch on each rank of its group (shared with `seqpar plan`)
    schedule.py  rows -> degrees, slots and micro-steps, balanced; the plan's predicted rank times
    meshes.py    the meshes of every degree (created once), group views, which rank runs what
"""
