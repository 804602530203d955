"""What leaves the sidecar for the downstream: the agent's spans relayed unchanged
(:mod:`.relay`, sent by :mod:`.senders`), the sidecar's own spans (:mod:`.telemetry`) and
metrics (:mod:`.metrics`), all to one OTLP downstream (:mod:`.downstream`); a breaker change
is told through both (:mod:`.breaker_report`).
"""
