"""The policy the sidecar enforces now, for the parts that read it at each use.

A reload (:meth:`supervisor.app.Sidecar.reload_policy`) replaces it. The
parts built once at start-up and told the policy only through this (the
remediations, the run tracker's detector settings, the control API) ask it
each time, so they follow a reload without being rebuilt or reaching into
the sidecar.
"""

from __future__ import annotations

from policies import DetectorSettings, Policy


class PolicyInForce:
    """Holds the current :class:`~policies.Policy`; calling it returns that policy."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy

    def __call__(self) -> Policy:
        return self._policy

    def replace(self, policy: Policy) -> None:
        """A reload: every later read sees ``policy``."""
        self._policy = policy

    def detectors_for(self, service: str) -> DetectorSettings:
        """The run detectors' settings for ``service`` under the current policy."""
        return self._policy.detectors.for_service(service)
