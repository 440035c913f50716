"""vLLM's ``revision``, ``code_revision`` and ``tokenizer_revision`` on local model paths.

There are no hub downloads here, so a revision cannot choose files. A folder of a Hugging Face cache
(``models--ORG--NAME/snapshots/COMMIT``) records its commit, and the revision is checked against it:
the commit (or a prefix of 7+ hex digits) or a ref (``refs/main``, ``refs/pr/1``) naming it. Any other
folder records nothing; transformers ignores ``revision=`` for a local folder, and so does this, with a warning.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

_HEX = re.compile(r"[0-9a-f]{7,40}")


def check_revisions(args, resolved) -> None:
    """Check each revision given in ``args`` against the resolved model / tokenizer path."""
    tokenizer_path = resolved.tokenizer_path
    if os.path.isfile(tokenizer_path):  # a .gguf file
        tokenizer_path = os.path.dirname(tokenizer_path)
    for name, path in (("revision", resolved.path), ("code_revision", resolved.path),
                       ("tokenizer_revision", tokenizer_path)):
        revision = getattr(args, name, None)
        if revision is not None:
            check_revision(name, revision, path)


def cache_snapshot(path: str) -> tuple[str, str] | None:
    """(repo folder, commit) when ``path`` is a Hugging Face cache snapshot folder, else None."""
    snapshot = os.path.abspath(path)
    snapshots = os.path.dirname(snapshot)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) != "snapshots" or not os.path.basename(repo).startswith("models--"):
        return None
    return repo, os.path.basename(snapshot)


def _ref_commit(repo: str, revision: str) -> str | None:
    ref = os.path.normpath(os.path.join(repo, "refs", revision))
    if not ref.startswith(os.path.join(repo, "refs") + os.sep) or not os.path.isfile(ref):
        return None
    with open(ref, encoding="utf-8") as f:
        return f.read().strip()


def revision_commit(repo: str, revision: str) -> str | None:
    """The commit ``revision`` names in the cache ``repo``: a ref, a snapshot's commit or its prefix; None if none."""
    commit = _ref_commit(repo, revision)
    if commit is not None:
        return commit
    snapshots = sorted(os.listdir(os.path.join(repo, "snapshots")))
    matches = [s for s in snapshots if s == revision or (_HEX.fullmatch(revision) and s.startswith(revision))]
    return matches[0] if len(matches) == 1 else None


def check_revision(name: str, revision: str, path: str) -> None:
    """ValueError when ``path`` is a cache snapshot of another commit; a warning when it records no revision."""
    if not isinstance(revision, str) or not revision:
        raise ValueError(f"{name} must be a branch, tag or commit name, got {revision!r}")
    found = cache_snapshot(path)
    if found is None:
        logger.warning("%s %r is not checked: %s is a local folder that records no revision (there are no hub "
                       "downloads); it is used as it is", name, revision, path)
        return
    repo, commit = found
    wanted = revision_commit(repo, revision)
    if wanted == commit:
        return
    if wanted is not None and os.path.isdir(os.path.join(repo, "snapshots", wanted)):
        hint = f"its snapshot is {os.path.join(repo, 'snapshots', wanted)}"
    else:
        hint = "the cache holds no snapshot of it (there are no hub downloads)"
    raise ValueError(f"{name} {revision!r} does not match {path}, the cache snapshot of commit {commit}; {hint}")
