"""The planner's harnesses: commands that drive the engine (and torchtitan's model) to
measure what the cost model in ``amsp_dtensor.plan`` predicts.

``profile`` measures this cluster's bandwidth table, ``simulate`` runs one step of the
real engine as one rank of a large job on torch's fake process group, and ``validate``
checks the model against real CPU runs. They sit above the engine they drive, so
``amsp_dtensor.plan`` imports nothing of them; their commands keep the planner's names
(``python -m amsp_dtensor.plan.profile`` and so on: thin entries in plan/ that run the
module here).
"""
