"""What a limit is for: a provider, a model and, optionally, the credential's *name*.

Providers limit per API key; agents sharing one key share its limit. The
agent names the credential (``"team-a"``) or gives a hash of it, never the
key itself: values that look like a provider's API key are refused, so that
no secret reaches Redis, logs or stats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["AdmissionKey", "CredentialRefused", "admission_key", "check_credential"]

#: Prefixes of providers' secret keys (OpenAI ``sk-``, Anthropic ``sk-ant-``, Google ``AIza``,
#: Groq ``gsk_``, xAI ``xai-``, Hugging Face ``hf_``, GitHub ``ghp_``/``github_pat_``).
_SECRET: Final = re.compile(r"^(sk-|sk_|gsk_|xai-|hf_|ghp_|github_pat_|AIza|pk-|rk-)", re.I)
#: A name or a hash: short, printable, no separators used in Redis keys.
_NAME: Final = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class CredentialRefused(ValueError):
    """The credential given looks like a secret, or is not a name."""


@dataclass(frozen=True, slots=True)
class AdmissionKey:
    provider: str
    model: str
    credential: str | None = None

    def __str__(self) -> str:
        base = f"{self.provider}:{self.model}"
        return base if self.credential is None else f"{base}@{self.credential}"


def admission_key(dependency: str, credential: str | None = None) -> AdmissionKey:
    """The key of ``dependency`` (``provider:model``, as spans name it) and a credential name."""
    provider, _, model = dependency.partition(":")
    if not provider or not model:
        raise ValueError(f"dependency {dependency!r} is not provider:model")
    if credential is not None:
        check_credential(credential)
    return AdmissionKey(provider, model, credential)


def check_credential(credential: str) -> str:
    """``credential`` if it is a credential's name or hash; else :class:`CredentialRefused`
    (whose message never repeats it)."""
    if _SECRET.match(credential):
        raise CredentialRefused("credential looks like an API key: give its name or a hash")
    if not _NAME.match(credential):
        raise CredentialRefused("credential must be a name or a hash ([A-Za-z0-9._-], <= 128)")
    return credential
