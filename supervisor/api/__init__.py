"""The control API on port 4320: routes (:mod:`.server`), what they do (:mod:`.control`),
inline decisions for ``POST /v1/decide`` (:mod:`.inline`), CPU per thread (:mod:`.thread_cpu`).
"""
