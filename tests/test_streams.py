"""The engine orders its CUDA streams with events (engine/streams.py's Note), read from
the package's source: no ``record_stream`` call unless the line before it says why an
event cannot serve (a comment containing "event cannot"). The stream order itself runs
in tools/gpu_check.py (tests/test_gpu_check.py runs its CPU part)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "amsp_dtensor"
REASON = "event cannot"


def unexplained_record_streams(source: str, relpath: str) -> list[str]:
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "record_stream"):
            before = lines[node.lineno - 2] if node.lineno >= 2 else ""
            if REASON not in before:
                found.append(f"{relpath}:{node.lineno}: record_stream without a comment "
                             f"saying why an {REASON} serve")
    return found


def test_no_unexplained_record_stream():
    found = [line for path in sorted(PACKAGE.rglob("*.py"))
             for line in unexplained_record_streams(path.read_text(),
                                                    str(path.relative_to(PACKAGE)))]
    assert found == [], "\n".join(found)


def test_the_scan_can_fail():
    bare = "def hook(t, s):\n    t.record_stream(s)\n"
    explained = ("def hook(t, s):\n    # an event cannot serve: the consumer is unknown\n"
                 "    t.record_stream(s)\n")
    assert len(unexplained_record_streams(bare, "x.py")) == 1
    assert unexplained_record_streams(explained, "x.py") == []


def test_stream_helpers_do_nothing_without_a_grad_stream():
    """On CPU the engine has no grad stream: nothing is kept, nothing waits."""
    import torch

    from amsp_dtensor.engine import streams

    assert streams.grad_stream("cpu") is None
    t = torch.ones(3)
    assert streams.Deferred.after_reads(None, None, [t]) is None
    assert streams.Deferred.kept(None, [t]) is None
    assert streams.current_stream(None) is None
    with streams.on_grad_stream(None):
        t.add_(1)
    streams.join_compute(None)
    streams.release_to(None, None)
    assert t.tolist() == [2.0, 2.0, 2.0]
