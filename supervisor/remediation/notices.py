"""Escalation notices: an approval request posted to a webhook as a Slack message.

The approval is stored before its notice is posted, and stays stored when the
post fails (the failure is counted); the notice is signed when there is a
secret, with one message id for every attempt, and retried on 5xx, 429 and
network errors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx
import orjson
import tenacity

from supervisor.act.signing import signature_headers

log = logging.getLogger("spanvisor.remediate")


class EscalationNotices:
    """Posts escalations to ``url`` (none: nothing is posted), signed with ``secret``."""

    def __init__(self, url: str | None, secret: str | None) -> None:
        self.url = url
        self.secret = secret
        #: Notices that could not be posted (the approval is stored all the same).
        self.errors = 0

    def post(self, approval_id: str, request: Mapping[str, Any]) -> None:
        """Post the escalation to ``url``: signed, retried on 5xx/429/network errors."""
        if not self.url:
            return
        body = orjson.dumps(slack_message(approval_id, request))
        headers = {"Content-Type": "application/json"}
        if self.secret:
            # One message id for every attempt: the receiver can drop repeats.
            headers.update(signature_headers(self.secret, f"ntf_{approval_id}", body))
        try:
            for attempt in tenacity.Retrying(
                stop=tenacity.stop_after_attempt(3),
                wait=tenacity.wait_random_exponential(multiplier=0.2, max=2),
                retry=tenacity.retry_if_exception(_worth_retrying),
                reraise=True,
            ):
                with attempt:
                    httpx.post(
                        self.url, content=body, headers=headers, timeout=5.0
                    ).raise_for_status()
        except httpx.HTTPError as exc:
            self.errors += 1
            log.warning(
                "could not post an escalation notice (the approval is stored): %s",
                exc,
                extra={"approval": approval_id},
            )


def _worth_retrying(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, httpx.TransportError)


def slack_message(approval_id: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """An escalation as Slack's incoming-webhook JSON (``text`` plus ``blocks``).

    Span text is shown as quoted code, never as markup a reader could mistake
    for the sidecar's own words.
    """
    what = request.get("what", {})
    where = request.get("where", {})
    summary = (
        f"spanvisor needs a decision: {what.get('kind', '?')} ({what.get('class', '?')})"
        f" on {what.get('dependency') or where.get('span_name', '?')}"
    )
    detail = (
        f"*service* {where.get('service', '')}  *run* {where.get('run_id', '')}\n"
        f"*why* {_code(str(request.get('why', '')))}\n"
        f"*approve*: {request.get('on_approve', '')}\n*deny*: {request.get('on_deny', '')}\n"
        f"`spanvisor approvals approve {approval_id}` or `... deny {approval_id}`"
    )
    return {
        "text": summary,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": summary}},
            {"type": "section", "text": {"type": "mrkdwn", "text": detail[:2900]}},
        ],
        "spanvisor": {"approval_id": approval_id, **dict(request)},
    }


def _code(text: str) -> str:
    return "`" + text.replace("`", "'")[:500] + "`"
