"""The repository speaks for itself: no tracked file points at notes kept outside it
(the background notes' file names or folder), at tracker issues by number, or at an
external acceptance checklist. docs/design.md holds the background instead."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = (".py", ".md", ".toml", ".sh")

# Built from pieces so that this file does not match itself.
_PIECES = [
    r"PAPER" + r"\.md",
    r"DESIGN" + r"\.md",
    r"shared" + r"/amsp",
    r"[Ii]ssue" + r" [0-9]+",
    r"(?<!&)#" + r"[0-9]{2,}\b",  # an issue or pull request by number (not an HTML entity)
    r"(?i:must)" + r"[- ]show",
    r"team" + r" brief",
]
PATTERN = re.compile("|".join(_PIECES))

_SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", "outputs", "shared"}


def _tracked_files() -> list[Path]:
    """Files git tracks (git ls-files); without git, a walk of the tree."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
        names = [n for n in out.decode("utf-8", "replace").split("\0") if n]
        if names:
            return [ROOT / n for n in names]
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        files.extend(Path(dirpath) / f for f in filenames)
    return files


def _matches() -> list[str]:
    found = []
    for path in sorted(_tracked_files()):
        if path.suffix not in SUFFIXES or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            if PATTERN.search(line):
                found.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    return found


def test_pattern_catches_what_it_should():
    for bad in ("see " + "PAPER" + ".md", "DESIGN" + ".md, schedule", "/work/shared" + "/amsp",
                "fixed in issue" + " 3", "Issue" + " 12", "must" + "-show 2", "a must" + " show",
                "Must" + "-show 1", "the team" + " brief", "pytorch/pytorch#" + "135712", "see #" + "42"):
        assert PATTERN.search(bad), bad
    for fine in ("docs/design.md", "the issue of padding", "issued async", "paper.md",
                 "color #ffffff", "&#123;", "step #1"):
        assert not PATTERN.search(fine), fine


def test_no_references_outside_the_repository():
    found = _matches()
    assert not found, (
        "references to documents outside the repository, tracker issue numbers or an "
        "external checklist (say the thing itself, or point to docs/design.md or the paper "
        f"by section) in {len(found)} line(s):\n" + "\n".join(found)
    )
