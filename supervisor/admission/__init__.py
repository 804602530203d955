"""Admission control: a fleet asks a provider for no more than it accepts.

One idea per module: :mod:`.key` (what a limit is for), :mod:`.learner`
(the limit, learned from 429s by AIMD), :mod:`.bucket` (a token bucket,
fleet-wide in Redis or this sidecar's own) and :mod:`.admitter` (the
answer to "may I call now?", with priorities). See ``docs/admission.md``.
"""

from supervisor.admission.admitter import Admitter, Decision
from supervisor.admission.bucket import LocalBucket, RedisBucket, Take
from supervisor.admission.key import AdmissionKey, CredentialRefused, admission_key
from supervisor.admission.learner import Ceiling, Learner

__all__ = [
    "AdmissionKey",
    "Admitter",
    "Ceiling",
    "CredentialRefused",
    "Decision",
    "Learner",
    "LocalBucket",
    "RedisBucket",
    "Take",
    "admission_key",
]
