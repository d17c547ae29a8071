"""`python -m amsp_dtensor.plan.validate`: the cost model against a real CPU run of the engine.

The command lives in amsp_dtensor.harness.validate (it drives layers above the planner);
this entry only runs it, and imports nothing when imported.
"""

if __name__ == "__main__":
    import runpy

    runpy.run_module("amsp_dtensor.harness.validate", run_name="__main__", alter_sys=True)
