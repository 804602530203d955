"""The sidecar's side of remediation: dispatch to the durable runner (:mod:`.engine`), the
gateway remediators act through (:mod:`.gateway`), recovery watching (:mod:`.recovery`),
escalation notices (:mod:`.notices`).
"""
