"""Hugging Face Hub ids as `model.path` and `data.path` (OWNER/NAME[@REVISION]), and `export --push-to-hub`.

A local folder always wins: an id is only looked up when no such path exists. Files land in the standard Hugging
Face cache (HF_HOME / HF_HUB_CACHE), so transformers, TRL and shardtune share one copy; HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE act as in transformers (huggingface_hub reads them). Only what each command needs is fetched:
`plan` the config.json, `validate` the config and tokenizer files (it tokenizes data rows), `train` the safetensors
too; a repo without safetensors (an older one) gets its PyTorch `pytorch_model*.bin` files instead
(model/bin_weights.py reads them), never both. A revision already complete in the cache is used without asking
the Hub again: pin @REVISION (a commit) to take a newer one. A dataset id fetches the repo's data files
(data/hub_data.py turns the recipe's split into a saved dataset).

In a job, global rank 0 downloads while every other rank waits (one download, not one per rank; the cache is
expected on a filesystem the nodes share, like train.output_dir); a rank that cannot see the files afterwards
fetches its own copy and warns.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from shardtune.errors import UserError

CONFIG = ("config.json",)
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
             "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
WEIGHTS = ("*.safetensors", "model.safetensors.index.json", "generation_config.json")
BIN_WEIGHTS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")  # fetched only when a repo has no safetensors
EVERYTHING = CONFIG + TOKENIZER + WEIGHTS
# A dataset repo's data files (what datasets' folder reader takes, compressed text too) and its card (split configs).
DATA = ("*.jsonl", "*.json", "*.parquet", "*.csv", "*.txt", "*.gz", "*.bz2", "*.xz", "*.arrow", "README.md")
# OWNER/NAME, optionally @REVISION (a branch, tag or commit): the Hub's own character set for both parts.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")
DOWNLOAD_WAIT = timedelta(hours=2)  # the other ranks' wait: a 140 GB model at 20 MB/s is ~2 h


def is_hub_id(value: Any) -> bool:
    """An OWNER/NAME[@REV] that is not an existing local path."""
    text = str(value)
    return bool(_REPO_ID.match(text)) and not Path(text).expanduser().exists()


def split_id(value: str) -> tuple[str, str | None]:
    repo, _, revision = value.partition("@")
    return repo, revision or None


def check_repo_id(value: str, key: str) -> None:
    if not _REPO_ID.match(value) or "@" in value:
        raise UserError(f"{key}: '{value}' is not a Hugging Face repo id: give OWNER/NAME")


def model_dir(value: str | Path, patterns: Sequence[str] = CONFIG, *, key: str = "model.path") -> Path:
    """A local folder as is; a hub id -> its snapshot folder in the HF cache, holding `patterns` (fetched when the
    cache does not have them yet)."""
    if not is_hub_id(value):
        return Path(value)
    repo, revision = split_id(str(value))
    cached = _cached(repo, revision, patterns)
    if cached is not None:
        return cached
    folder = _download(repo, revision, patterns, key=key)
    if "*.safetensors" in patterns and not any(folder.glob("*.safetensors")):  # an older repo: .bin weights only
        folder = _download(repo, revision, (*patterns, *BIN_WEIGHTS), key=key)
    return folder


def dataset_dir(value: str) -> Path:
    """A dataset id -> its snapshot folder in the HF cache, holding the repo's data files (fetched once)."""
    repo, revision = split_id(value)
    cached = _cached(repo, revision, DATA, repo_type="dataset")
    if cached is not None:
        return cached
    return _download(repo, revision, DATA, key="data.path", repo_type="dataset")


def _cached(repo: str, revision: str | None, patterns: Sequence[str], repo_type: str = "model") -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=list(patterns), local_files_only=True,
                                        repo_type=repo_type))
    except (LocalEntryNotFoundError, IncompleteSnapshotError):
        return None
    # A cache filled by another tool may lack the tree listing that lets huggingface_hub tell a partial snapshot:
    # the files a command cannot do without are checked here.
    if "config.json" in patterns and not (folder / "config.json").is_file():
        return None
    if "*.safetensors" in patterns and not any(folder.glob("*.safetensors")) and \
            not any(folder.glob(BIN_WEIGHTS[0])):  # an older repo's .bin weights do too
        return None
    return folder


def _download(repo: str, revision: str | None, patterns: Sequence[str], *, key: str,
              repo_type: str = "model") -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo + (f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(patterns), repo_type=repo_type))
    except GatedRepoError:
        raise UserError(f"{key}: '{name}' is gated: accept its terms on the Hub, then set HF_TOKEN (or run "
                        "`hf auth login`)") from None
    except RevisionNotFoundError:
        raise UserError(f"{key}: '{name}': no such revision on the Hub: fix the part after @") from None
    except RepositoryNotFoundError:
        raise UserError(f"{key}: '{name}' is neither a local path nor a {repo_type} on the Hub (or it is private: "
                        "set HF_TOKEN): fix the path or the repo id") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"{key}: '{name}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                            "HF_HUB_OFFLINE is set: download it once online, or unset HF_HUB_OFFLINE") from None
        raise UserError(f"{key}: '{name}' is not in the Hugging Face cache and the Hub ({constants.ENDPOINT}) "
                        "cannot be reached: check the network, or set HF_HUB_OFFLINE=1 with a filled cache") from None
    except (HfHubHTTPError, OSError) as e:
        raise UserError(f"{key}: downloading '{name}' failed ({str(e).splitlines()[0][:160]}): check the network "
                        "and free space in the Hugging Face cache") from None


def fetch_for_ranks(value: str, *, rank: int) -> None:
    """Collective over the job: global rank 0 downloads the model, the others wait, then check they see it."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        model_dir(value, EVERYTHING)
        return
    group = dist.new_group(backend="gloo", timeout=DOWNLOAD_WAIT)
    msg: list[str | None] = [None]
    failure: UserError | None = None
    if rank == 0:
        try:
            model_dir(value, EVERYTHING)
        except UserError as e:
            msg, failure = [str(e)], e
    dist.broadcast_object_list(msg, src=0, group=group)
    dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    if msg[0] is not None:
        raise UserError(msg[0])
    repo, revision = split_id(value)
    if rank != 0 and _cached(repo, revision, EVERYTHING) is None:
        warnings.warn(f"model.path: '{value}' (downloaded by rank 0) is not in this node's Hugging Face cache: "
                      "downloading a copy here; put HF_HUB_CACHE on a filesystem all nodes share", stacklevel=2)
        model_dir(value, EVERYTHING)


def push_folder(folder: Path, repo: str) -> str:
    """Every file of `folder` as one commit to `repo` (created private when missing). Returns the commit URL."""
    import httpx2  # huggingface_hub's HTTP client: its connection errors are not OSErrors
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    try:
        api.create_repo(repo, private=True, exist_ok=True)
        info = api.create_commit(repo, operations=[CommitOperationAdd(str(p.relative_to(folder)), str(p))
                                                   for p in files],
                                 commit_message=f"Upload {folder.name} with shardtune")
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        fix = ("set HF_TOKEN to a token with write access (or run `hf auth login`)" if status in (401, 403)
               else "check the repo id and the network")
        raise UserError(f"--push-to-hub {repo}: the Hub refused the upload ({str(e).splitlines()[0][:160]}): "
                        f"{fix}; the export itself is complete in '{folder}'") from None
    except (OSError, httpx2.HTTPError) as e:
        raise UserError(f"--push-to-hub {repo}: the Hub cannot be reached ({str(e).splitlines()[0][:160]}): the "
                        f"export is complete in '{folder}'; push it later with `hf upload {repo} {folder}`") from None
    return str(info.commit_url)
