"""Reaching a model, tokenizer or data set on the Hugging Face Hub: every way it can fail, as one `UserError` that
names what could not be reached and what to do.

    with reaching("--model", name, revision=revision, revision_flag="--revision"):
        AutoConfig.from_pretrained(name, revision=revision)

Recognised anywhere in the exception's chain (transformers and datasets wrap huggingface_hub's errors):
    gated repository        accept its licence on its page, then `hf auth login` or HF_TOKEN
    revision not found      pass a branch, tag or commit the repository has
    repository not found    check the spelling (or log in, for a private one)
    not cached, offline     HF_HUB_OFFLINE=1 forbids the download: `hf download ...` ahead, or unset it
    not cached, no network  retry, or download ahead and work offline from the cache
Anything else is re-raised unchanged (a bug to report, not a user's mistake). Imports only zero_utils.run.errors.
"""

from __future__ import annotations

import contextlib
import re

from zero_utils.run.errors import UserError

_NETWORK_ERRORS = ("ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "gaierror", "ConnectionError",
                   "NewConnectionError", "MaxRetryError", "RemoteDisconnected", "ProtocolError")


def _chain(error: BaseException) -> list[BaseException]:
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def failure_sentence(error: BaseException, flag: str, name: str, *, revision: str | None = None,
                     revision_flag: str = "--revision", repo_type: str = "model") -> str | None:
    """The one sentence for a failure to reach `name` (given as `flag`), or None when `error` is not one."""
    from huggingface_hub import errors as hub

    chain = _chain(error)
    texts = " ".join(str(e) for e in chain)
    names = {type(e).__name__ for e in chain} | set(re.findall(r"\((\w+(?:Error|Enabled))\)", texts))  # datasets
    download = f"hf download {'--repo-type dataset ' if repo_type == 'dataset' else ''}{name}"
    if any(isinstance(e, hub.GatedRepoError) for e in chain):
        return (f"{flag} {name!r} is a gated repository: accept its licence on https://huggingface.co/"
                f"{'datasets/' if repo_type == 'dataset' else ''}{name}, then log in with `hf auth login` (or set "
                "HF_TOKEN).")
    if any(isinstance(e, hub.RevisionNotFoundError) for e in chain):
        return f"{revision_flag} {revision!r} does not exist in {name!r}; pass a branch, tag or commit it has."
    if any(isinstance(e, hub.RepositoryNotFoundError) for e in chain) or "DatasetNotFoundError" in names:
        return (f"{flag} {name!r} does not exist on the Hub (or is private): check the spelling, or log in with "
                "`hf auth login` for a private repository.")
    offline = _offline() or "OfflineModeIsEnabled" in names
    not_cached = names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"} or "is not cached" in texts
    if offline and (not_cached or names & set(_NETWORK_ERRORS)):
        return (f"{flag} {name!r} is not in the local cache and HF_HUB_OFFLINE=1 forbids downloading it; download "
                f"it ahead with `{download}` (on a machine with network, into the same HF_HOME), or unset "
                "HF_HUB_OFFLINE.")
    if not_cached or names & set(_NETWORK_ERRORS):
        return (f"could not reach the Hub for {flag} {name!r} (a network error) and it is not in the local cache; "
                f"retry, or download it ahead with `{download}` and set HF_HUB_OFFLINE=1 to work from the cache.")
    return None


@contextlib.contextmanager
def reaching(flag: str, name: str, *, revision: str | None = None, revision_flag: str = "--revision",
             repo_type: str = "model"):
    """Context: a failure to reach `name` inside becomes a `UserError` with `failure_sentence`'s sentence (raised
    without the library's traceback); other exceptions pass unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        sentence = failure_sentence(error, flag, name, revision=revision, revision_flag=revision_flag,
                                    repo_type=repo_type)
        if sentence is None:
            raise
        raise UserError(sentence) from None
