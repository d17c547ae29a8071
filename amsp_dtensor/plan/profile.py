"""`python -m amsp_dtensor.plan.profile`: measure this cluster's bandwidth table.

The command lives in amsp_dtensor.harness.profile (it drives layers above the planner);
this entry only runs it, and imports nothing when imported.
"""

if __name__ == "__main__":
    import runpy

    runpy.run_module("amsp_dtensor.harness.profile", run_name="__main__", alter_sys=True)
