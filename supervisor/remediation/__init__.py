"""The sidecar's side of remediation (:mod:`.engine`): dispatch to the durable runner,
the gateway remediators act through, recovery watching, notices.
"""
