"""The Hugging Face cache as a model source: ``ORG/NAME@REVISION`` -> a snapshot directory, offline.

``huggingface-cli download ORG/NAME --revision REV`` (or ``from_pretrained``) stores a repository under the hub
cache as::

    models--ORG--NAME/refs/<branch or tag>   a text file holding the commit hash the name pointed to
    models--ORG--NAME/snapshots/<commit>/    the files of that commit (links into blobs/)

A reference resolves by reading that layout and nothing else (no hub function is called, so nothing can reach
the network): a branch or tag name through ``refs/``, a full or shortened (>= 7 hex digits) commit hash through
``snapshots/``; no revision means ``main``. The cache is the one huggingface_hub uses: ``HF_HUB_CACHE`` (or the
older ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``. A revision that is not there is one error listing the revisions that are.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Optional

# ORG/NAME or NAME, optionally @REVISION; the names as the hub allows them (letters, digits, '-', '_', '.').
_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<rev>[^@\s]+))?$")
_HEX = re.compile(r"^[0-9a-f]{7,40}$")
DEFAULT_REVISION = "main"
LISTED = 12  # revisions named in an error before "..."


class CacheError(ValueError):
    """A reference that the Hugging Face cache cannot resolve; the message lists what the cache holds."""


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """``repo_id`` ("ORG/NAME"), ``revision`` (a branch, tag or commit; None: ``main``)."""

    repo_id: str
    revision: Optional[str] = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_ref(text: str) -> Optional[ModelRef]:
    """``ORG/NAME[@REVISION]`` (or ``NAME[@REVISION]``) -> ModelRef; None when ``text`` is not of that form (an
    absolute or ``./`` path, a file name with a suffix such as ``.json``, several slashes ...)."""
    m = _REF.match(str(text))
    if m is None or text.endswith((".json", ".safetensors", ".bin")):
        return None
    return ModelRef(m.group("repo"), m.group("rev"))


def hub_cache_dir() -> Path:
    """The hub cache directory huggingface_hub would use, read from the environment at call time."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def repo_folder(repo_id: str) -> str:
    """``models--ORG--NAME``: the cache folder of a model repository."""
    return "models--" + repo_id.replace("/", "--")


def cached_repos(cache: Path) -> list[str]:
    """Repository ids of the models in a hub cache directory, sorted."""
    if not Path(cache).is_dir():
        return []
    return sorted(d.name[len("models--"):].replace("--", "/") for d in Path(cache).iterdir()
                  if d.name.startswith("models--") and d.is_dir())


def branches(repo_dir: Path) -> dict[str, str]:
    """Branch/tag name -> commit hash, from ``refs/`` (names may hold slashes: ``refs/pr/1``)."""
    refs = Path(repo_dir) / "refs"
    out = {}
    if refs.is_dir():
        for f in sorted(refs.rglob("*")):
            if f.is_file():
                out[f.relative_to(refs).as_posix()] = f.read_text(encoding="utf-8", errors="replace").strip()
    return out


def snapshots(repo_dir: Path) -> list[str]:
    """Commit hashes that have a snapshot directory, sorted."""
    snaps = Path(repo_dir) / "snapshots"
    return sorted(d.name for d in snaps.iterdir() if d.is_dir()) if snaps.is_dir() else []


def revisions(repo_dir: Path) -> dict[str, Path]:
    """Every revision of a cached repository that has files: branch/tag names (through ``refs/``) and commit
    hashes -> snapshot directory."""
    have = set(snapshots(repo_dir))
    out = {name: Path(repo_dir) / "snapshots" / commit for name, commit in branches(repo_dir).items() if commit in have}
    out.update({commit: Path(repo_dir) / "snapshots" / commit for commit in sorted(have)})
    return out


def resolve(ref: ModelRef, cache: Optional[Path] = None, *, error=CacheError, no_local_dir: bool = False) -> Path:
    """The snapshot directory of ``ref`` in the hub ``cache`` (default ``hub_cache_dir()``); ``error`` naming the
    cache and listing the revisions it holds when the repository or the revision is not there (``no_local_dir``:
    the message also says that no local directory has that name)."""
    cache = hub_cache_dir() if cache is None else Path(cache)
    repo_dir = cache / repo_folder(ref.repo_id)
    try:
        os.stat(repo_dir)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:  # HF_HUB_CACHE too long, or a directory that may not be searched
        raise error(f"{ref}: the Hugging Face cache {str(cache)[:300]} cannot be looked at ({e.strerror or e}); "
                    "set HF_HUB_CACHE / HF_HOME") from None
    if not repo_dir.is_dir():
        have = cached_repos(cache)
        listing = _listing(have) if have else "none"
        local = "no local directory of that name, and " if no_local_dir else ""
        raise error(f"{ref}: {local}not in the Hugging Face cache {cache} (no {repo_dir.name}/; models there: "
                    f"{listing}); "
                    f"download it with `huggingface-cli download {ref.repo_id}"
                    + (f" --revision {ref.revision}`" if ref.revision else "`") + " or set HF_HUB_CACHE / HF_HOME")
    revision = ref.revision or DEFAULT_REVISION
    if _escapes(revision):
        raise error(f"{ref}: revision {revision!r} is not a branch, tag or commit name")
    names, commits = branches(repo_dir), snapshots(repo_dir)
    if revision in names:
        commit = names[revision]
        if commit not in commits:
            raise error(f"{ref}: refs/{revision} points to commit {commit[:40]!r}, which has no snapshot in {repo_dir} "
                        f"(an interrupted download?); {_present(names, commits)}")
        return repo_dir / "snapshots" / commit
    matches = [c for c in commits if c.startswith(revision)] if _HEX.match(revision) else []
    if len(matches) == 1:
        return repo_dir / "snapshots" / matches[0]
    if len(matches) > 1:
        raise error(f"{ref}: commit prefix {revision!r} matches {len(matches)} snapshots ({_listing(matches)}); "
                    f"give more digits")
    raise error(f"{ref}: revision {revision!r} is not in the Hugging Face cache ({repo_dir}); "
                f"{_present(names, commits)}")


def model_dir(path_or_ref, cache: Optional[Path] = None, *, error=CacheError) -> Path:
    """A local model directory: ``path_or_ref`` itself when it exists on disk, else its snapshot in the hub cache
    when it reads as ``ORG/NAME[@REVISION]``, else ``path_or_ref`` unchanged (the loader then says it is not
    found)."""
    path = Path(path_or_ref)
    try:
        if path.exists():
            return path
    except OSError:  # a name too long, a directory that may not be searched: the caller's check names it
        return path
    ref = parse_ref(str(path_or_ref))
    return path if ref is None else resolve(ref, cache, error=error, no_local_dir=True)


def _escapes(revision: str) -> bool:
    parts = revision.split("/")
    return revision.startswith("/") or any(p in ("", ".", "..") for p in parts)


def _present(names: dict[str, str], commits: list[str]) -> str:
    named = [f"{n} ({c[:7]})" for n, c in names.items() if c in commits]
    loose = [c[:12] for c in commits if c not in names.values()]
    return "revisions present: " + (_listing(named + loose) if named or loose else "none (no snapshots)")


def _listing(items: list[str]) -> str:
    return ", ".join(items[:LISTED]) + (f", ... ({len(items)} in all)" if len(items) > LISTED else "")
