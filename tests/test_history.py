"""History a reader can scan: every commit since the rule began has a subject of at
most 72 characters and a blank line after it (.githooks/commit-msg enforces it when
committing; this test, run by CI, fails a commit that slipped past the hook)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RULE_SINCE = "276c4d2"  # the last commit before the rule: earlier history is as it was


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _history_available() -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False
    return subprocess.run(["git", "cat-file", "-e", f"{RULE_SINCE}^{{commit}}"], cwd=ROOT,
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _history_available(), reason="no git history here (an archive, or a shallow clone)")
def test_every_commit_since_the_rule_has_a_short_subject_and_a_blank_second_line():
    bad = []
    for record in _git("log", "--format=%h%x00%B%x1e", f"{RULE_SINCE}..HEAD").split("\x1e"):
        if not record.strip():
            continue
        sha, body = record.strip().split("\x00", 1)
        lines = body.splitlines()
        if len(lines[0]) > 72 or (len(lines) > 1 and lines[1].strip()):
            bad.append(f"{sha} ({len(lines[0])} characters): {lines[0][:80]}")
    assert not bad, "commit subjects over 72 characters or without a blank line after:\n" + "\n".join(bad)


def test_the_commit_msg_hook_refuses_a_long_subject_and_takes_a_short_one(tmp_path):
    hook = ROOT / ".githooks" / "commit-msg"
    long_msg, short_msg = tmp_path / "long", tmp_path / "short"
    long_msg.write_text("x" * 73 + "\n\nbody\n")
    short_msg.write_text("sync: stage full pushes before the pause\n\nwhy and figures\n# a comment\n")
    assert subprocess.run([str(hook), str(long_msg)], capture_output=True).returncode == 1
    assert subprocess.run([str(hook), str(short_msg)], capture_output=True).returncode == 0
