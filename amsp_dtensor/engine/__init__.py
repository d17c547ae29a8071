"""The AMSP engine: what runs inside a training step.

- ``mesh``, ``layouts``: the ("rep", "p", "g", "os") DeviceMesh and the P/G/OS row layouts;
- ``shard``: ``fully_shard``, FSDP2 for P plus the engine's hooks;
- ``unit``, ``root``, ``lifecycle``: one unit's step state and its gradient stages, the
  root's per-step state, the table of allowed transitions;
- ``grad``, ``param_update``, ``optim``, ``sharded_adafactor``: the gradient path's entry
  points, the post-step all-gather, the OS-sharded optimizer;
- ``collectives``, ``recorder``, ``streams``, ``overlap``, ``handle``, ``fqn``: the
  collectives (one pending type that owns its buffers) and the recorder they emit into,
  CUDA stream order, the overlap switches, the engine's handle on torch objects, names.

The public API is re-exported by ``amsp_dtensor``.
"""
