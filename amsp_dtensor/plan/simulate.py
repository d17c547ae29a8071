"""`python -m amsp_dtensor.plan.simulate`: one step of the real engine as one rank of a large job.

The command lives in amsp_dtensor.harness.simulate (it drives layers above the planner);
this entry only runs it, and imports nothing when imported.
"""

if __name__ == "__main__":
    import runpy

    runpy.run_module("amsp_dtensor.harness.simulate", run_name="__main__", alter_sys=True)
