"""Hugging Face Hub names where a path is accepted: `owner/repo`, or `owner/repo:file` for one file.

A name is a hub name only when no such local path exists. Downloads go through huggingface_hub, so
its cache (`HF_HOME`, `HF_HUB_CACHE`), token and `HF_HUB_OFFLINE` apply; `download_dir` replaces the
cache directory. A GGUF repository resolves to its one `.gguf` file; an HF-layout repository to a
snapshot of its configs, tokenizer and safetensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from flint_sched import envs
from flint_sched.checkpoint.common import CheckpointError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
HF_LAYOUT_FILES = ["*.json", "*.safetensors", "*.jinja"]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"]


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    filename: str | None = None       # from `owner/repo:file`


@dataclass(frozen=True)
class Resolved:
    path: str                          # what the loaders read
    origin: str                        # how it was found, for the start-up summary


def parse_hub_name(name: str | os.PathLike | None) -> HubRef | None:
    """The hub reference `name` spells, or None for a local path (existing or not) or a preset."""
    if name is None:
        return None
    text = str(name)
    if os.path.exists(text) or text.startswith((".", "/", "~")) or text.count("/") != 1:
        return None
    repo_id, _, filename = text.partition(":")
    if not _REPO_ID.match(repo_id) or repo_id.endswith((".gguf", ".json")):
        return None
    return HubRef(repo_id, filename or None)


def resolve_model(name: str | None, revision: str | None = None, download_dir: str | None = None) -> Resolved | None:
    """A hub model name as a local path (downloading what is missing), or None when not a hub name."""
    ref = parse_hub_name(name)
    if ref is None:
        return None
    if ref.filename:
        return Resolved(_download(ref.repo_id, ref.filename, revision, download_dir), _origin(ref, revision))
    files = _list_files(ref.repo_id, revision, download_dir)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return Resolved(_download(ref.repo_id, ggufs[0], revision, download_dir), _origin(ref, revision, ggufs[0]))
    if len(ggufs) > 1:
        raise CheckpointError(f"{ref.repo_id} holds several GGUF files ({', '.join(ggufs)}): name one as "
                              f"{ref.repo_id}:{ggufs[0]}")
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        path = _snapshot(ref.repo_id, revision, download_dir, HF_LAYOUT_FILES)
        return Resolved(path, _origin(ref, revision))
    raise CheckpointError(f"{ref.repo_id}: holds neither a .gguf file nor config.json with safetensors "
                          f"(files: {', '.join(sorted(files)[:10]) or 'none'})")


def resolve_config(name: str | None, revision: str | None = None, download_dir: str | None = None) -> Resolved | None:
    """A hub name given as --hf-config-path: the repository's config.json (or the named file), and
    its generation_config.json beside it where the repository has one (checkpoint/generation_config.py)."""
    ref = parse_hub_name(name)
    if ref is None:
        return None
    filename = ref.filename or "config.json"
    path = _download(ref.repo_id, filename, revision, download_dir)
    if filename == "config.json":
        try:
            _download(ref.repo_id, "generation_config.json", revision, download_dir)
        except CheckpointError:                # none: vLLM's sampling defaults
            pass
    return Resolved(path, _origin(ref, revision, filename))


def resolve_tokenizer(name: str | None, revision: str | None = None,
                      download_dir: str | None = None) -> Resolved | None:
    """A hub name given as --tokenizer: a directory with its tokenizer.json and tokenizer_config.json."""
    ref = parse_hub_name(name)
    if ref is None:
        return None
    if ref.filename:
        return Resolved(_download(ref.repo_id, ref.filename, revision, download_dir), _origin(ref, revision))
    return Resolved(_snapshot(ref.repo_id, revision, download_dir, TOKENIZER_FILES), _origin(ref, revision))


def _origin(ref: HubRef, revision: str | None, filename: str | None = None) -> str:
    where = ref.repo_id + (f":{filename or ref.filename}" if (filename or ref.filename) else "")
    offline = ", offline: cache only" if envs.hf_hub_offline() else ""
    return f"Hugging Face Hub {where} (revision {revision or 'main'}{offline})"


def _list_files(repo_id: str, revision: str | None, download_dir: str | None) -> list[str]:
    """The repository's files: from the hub, or from the cached snapshot when offline."""
    if envs.hf_hub_offline():
        root = Path(_snapshot(repo_id, revision, download_dir, None))
        return [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    from huggingface_hub import HfApi
    return _hub_call(repo_id, lambda: HfApi().list_repo_files(repo_id, revision=revision))


def _download(repo_id: str, filename: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import hf_hub_download
    return _hub_call(f"{repo_id}:{filename}", lambda: hf_hub_download(
        repo_id, filename, revision=revision, cache_dir=download_dir, local_files_only=envs.hf_hub_offline()))


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, patterns: list[str] | None) -> str:
    from huggingface_hub import snapshot_download
    return _hub_call(repo_id, lambda: snapshot_download(
        repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
        local_files_only=envs.hf_hub_offline()))


def _hub_call(what: str, call):
    """Run a huggingface_hub call; its failures become one CheckpointError naming the repository."""
    import httpx
    from huggingface_hub import errors
    try:
        return call()
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        raise CheckpointError(f"{what}: not in the Hugging Face cache and downloads are off (HF_HUB_OFFLINE); "
                              f"run once online, or point --download-dir at a cache holding it ({e})") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        raise CheckpointError(f"{what}: no such Hugging Face repository, or it needs a token "
                              f"(`hf auth login` or HF_TOKEN) ({type(e).__name__})") from None
    except (errors.RevisionNotFoundError, errors.EntryNotFoundError) as e:
        raise CheckpointError(f"{what}: not found on the Hugging Face Hub ({type(e).__name__}: {e})") from None
    except (errors.HfHubHTTPError, errors.HFValidationError, httpx.HTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{what}: cannot fetch it from the Hugging Face Hub ({type(e).__name__}: {e})") from None
