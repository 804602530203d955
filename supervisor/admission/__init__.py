"""Admission control: a fleet asks a provider for no more than it accepts.

One idea per module: :mod:`.key` (what a limit is for), :mod:`.learner`
(the limit, learned from 429s by AIMD; :mod:`.shared_learning`: the fleet's,
in Redis), :mod:`.bucket` (a token bucket,
this sidecar's own; :mod:`.shared`: the fleet's, in Redis) and :mod:`.admitter` (the
answer to "may I call now?", with priorities); :mod:`.config` reads the
policy's section (it needs pydantic, so it is not imported here: agents import
the client, which imports this package). See ``docs/admission.md``.
"""

from supervisor.admission.admitter import Admitter, Decision
from supervisor.admission.bucket import LocalBucket, Take
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
    "Take",
    "admission_key",
]
