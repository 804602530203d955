"""Judging a batch: attribution ("reported once, at the origin"), classification, decision.

* :mod:`.pipeline`: :class:`Pipeline`, from a request's span views to outcomes;
* :mod:`.attribution`: which failing span a failure originates at;
* :mod:`.failures`: the failures the pipeline reports, built from records and detections;
* :mod:`.replay`: the same judging over recorded traces (``spanvisor replay``).
"""
