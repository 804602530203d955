"""Settings of the sidecar: defaults, a YAML file, ``SPANVISOR_*`` variables.

Precedence, highest first: explicit overrides (CLI flags), ``SPANVISOR_*``
environment variables, the YAML settings file, defaults; pydantic-settings reads
and merges them, key by key (``supervisor.settings_sources``). Where forwarded
and own spans go is read from the standard ``OTEL_EXPORTER_OTLP_*`` variables
unless the settings name a downstream explicitly.

Every knob is finite by default; loading never exits the process: errors are
raised as :class:`~supervisor.errors.ConfigError` and turned into exit codes by
the CLI only.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from supervisor.addresses import DEFAULT_API_PORT, default_token_file
from supervisor.addresses import LOOPBACK as LOOPBACK  # noqa: PLC0414 - imported from here too
from supervisor.errors import ConfigError
from supervisor.settings_sources import current_load, loading


class DownstreamSettings(BaseModel):
    """An explicit downstream; when absent, ``OTEL_EXPORTER_OTLP_*`` decide."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str
    protocol: Literal["grpc", "http/protobuf"] = "http/protobuf"
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(default=10.0, gt=0, le=300)
    compression: Literal["none", "gzip"] = "none"


class WebhookChannel(BaseModel):
    """POST each command, signed (HMAC-SHA256, Standard Webhooks) with the secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://", description="The agent's webhook endpoint.")
    secret: str | None = Field(default=None, min_length=16, description="Signing secret.")
    secret_env: str | None = Field(
        default=None, description="Name of the environment variable holding the secret."
    )
    timeout_s: float = Field(default=5.0, gt=0, le=60)
    headers: dict[str, str] = Field(default_factory=dict)

    def resolved_secret(self) -> str:
        """The secret itself; ConfigError when neither it nor its variable is set."""
        if self.secret:
            return self.secret
        value = os.environ.get(self.secret_env or "", "")
        if len(value) < 16:
            raise ConfigError(
                f"webhook {self.url}: set secret (16+ characters) or secret_env naming a"
                " variable that holds one"
            )
        return value


class CommandChannel(BaseModel):
    """Run an executable (no shell) per command; span values only as whole arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[str] = Field(min_length=1, max_length=64)
    timeout_s: float = Field(default=10.0, gt=0, le=600)
    env: dict[str, str] = Field(default_factory=dict)


class PullChannel(BaseModel):
    """The agent fetches commands (``GET /v1/commands?service=...&wait=...``) and acks them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    visibility_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="An unacknowledged command is handed out again after this.",
    )
    ttl_s: float = Field(
        default=3600.0,
        gt=0,
        le=7 * 86_400,
        description="A command nobody fetched is dead-lettered after this.",
    )


class AgentDelivery(BaseModel):
    """How commands reach one agent service: exactly one channel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    webhook: WebhookChannel | None = None
    command: CommandChannel | None = None
    pull: PullChannel | None = None
    max_attempts: int = Field(
        default=8, ge=1, le=100, description="Push attempts before dead-lettering."
    )

    @model_validator(mode="after")
    def _one_channel(self) -> AgentDelivery:
        chosen = [n for n in ("webhook", "command", "pull") if getattr(self, n) is not None]
        if len(chosen) != 1:
            raise ValueError(f"set exactly one of webhook, command, pull (got {chosen or 'none'})")
        return self

    @property
    def channel(self) -> str:
        return "webhook" if self.webhook else "command" if self.command else "pull"


class Settings(BaseSettings):
    """Everything ``spanvisor run`` needs; see ``config/spanvisor.yaml``."""

    model_config = SettingsConfigDict(
        env_prefix="SPANVISOR_", extra="forbid", frozen=True, env_nested_delimiter="__"
    )

    host: str = Field(default=LOOPBACK, description="Address the OTLP receivers bind to.")
    otlp_token: str | None = Field(
        default=None,
        description="Bearer token the OTLP receivers require (HTTP `Authorization` header,"
        " gRPC `authorization` metadata). Needed when `host` is beyond loopback, unless"
        " otlp_unauthenticated is set.",
    )
    otlp_unauthenticated: bool = Field(
        default=False,
        description="Let the OTLP receivers listen beyond loopback without a token (logged"
        " at start): only behind a network that authenticates senders itself.",
    )
    otlp_grpc_port: int = Field(default=4317, ge=0, le=65535)
    otlp_http_port: int = Field(default=4318, ge=0, le=65535)
    api_host: str = Field(default=LOOPBACK, description="Address the control API binds to.")
    api_port: int = Field(default=DEFAULT_API_PORT, ge=0, le=65535)
    api_token: str | None = Field(
        default=None,
        description="Bearer token for the control API. Unset: a random one is made "
        "at start and written to token_file (mode 0600).",
    )
    token_file: Path = Field(
        default_factory=default_token_file,
        description="Where the token made at start is written, and clients read it"
        " (SPANVISOR_TOKEN_FILE).",
    )
    ui_enabled: bool = Field(
        default=True,
        description="Serve the operator console at /ui on the control API's port, behind"
        " the same token; false: no /ui at all.",
    )
    ui_trace_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s]*\{trace_id\}",
        description="Where the console links a run's trace: a URL with {trace_id}, e.g."
        " http://localhost:16686/trace/{trace_id} (Jaeger); unset: no link.",
    )
    ui_session_ttl_s: float = Field(
        default=8 * 3600.0,
        ge=60,
        le=30 * 86_400,
        description="How long a console login lasts (seconds) before the token is asked again.",
    )
    policy: Path | None = Field(default=None, description="Policy file; unset: the built-in one.")
    observe_only: bool = Field(default=False, description="Compute and trace decisions only.")

    # 64 MiB: LangGraph's spans carry the graph's whole state, and an exporter's
    # backlog after a sidecar restart (512 such spans) passed 16 MiB; OTLP
    # exporters do not retry a 413, so a batch over the limit is lost.
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    ingest_queue_batches: int = Field(default=2048, ge=1, le=1_000_000)
    ingest_queue_spans: int = Field(default=500_000, ge=1, le=50_000_000)
    ingest_queue_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1024,
        le=64 * 1024**3,
        description="Most bytes ingest holds (encoded batches queued or being judged, plus"
        " bodies being received or decoded); past it, OTLP throttling. Memory is about 4x"
        " it, plus about 100 MiB for the batch being judged and the pipeline's state.",
    )
    retry_after_s: float = Field(default=1.0, gt=0, le=60)
    ingest_log_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=0,
        le=64 * 1024**3,
        description="Most bytes of acknowledged requests kept on disk (beside state_path) until"
        " their failures are stored; past it ingest throttles. 0: no log (a 200 is then"
        " not durable across a crash).",
    )
    http_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="Most seconds to receive a request's headers (then the connection is"
        " closed) and an OTLP/HTTP request's body (then 408).",
    )

    recent_failures: int = Field(default=1000, ge=1, le=1_000_000)
    tracked_runs: int = Field(default=10_000, ge=1, le=10_000_000)
    track_runs: bool = Field(
        default=True,
        description="Track every run's progress and detect loops and stalls (see 'detectors'"
        " in the policy); false: neither, for the lowest cost per span.",
    )
    seen_failure_spans: int = Field(default=20_000, ge=1, le=10_000_000)

    forward_queue_batches: int = Field(default=1024, ge=1, le=1_000_000)
    forward_queue_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=8 * 1024**3)
    forward_max_attempts: int = Field(default=5, ge=1, le=100)
    downstream: DownstreamSettings | None = None

    agents: dict[str, AgentDelivery] = Field(
        default_factory=dict,
        description="Delivery per agent service name; '*' for every other service. "
        "Without an entry, a service's commands are stored as dead letters.",
    )
    state_path: Path = Field(
        default_factory=lambda: Path.home() / ".spanvisor" / "state.db",
        description="SQLite file of incidents, commands and approvals (':memory:' for none).",
    )
    database_url: str | None = Field(
        default=None,
        pattern=r"^postgres(ql)?(\+psycopg)?://",
        description="Keep incidents, commands and approvals in this PostgreSQL database,"
        " shared by every sidecar given it (postgresql://user@host:5432/db; a schema by"
        " ?options=-csearch_path%3Dname); unset: the SQLite file state_path.",
    )
    instance_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="This sidecar's name in the rows it writes (who judged, who delivered)"
        " and its remediation executor's in a fleet; unset: hostname:api_port.",
    )
    instance_heartbeat_s: float = Field(
        default=5.0,
        ge=0.1,
        le=60,
        description="With database_url: how often this sidecar writes its heartbeat in the"
        " shared store (and looks for dead sidecars to take over).",
    )
    instance_dead_after_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="With database_url: a sidecar without a heartbeat for this long is dead,"
        " and a live one resumes its remediations and sends its claimed commands; more than"
        " twice instance_heartbeat_s.",
    )
    breaker_redis_url: str | None = Field(
        default=None,
        pattern=r"^rediss?://",
        description="Share breaker state with every sidecar using this Redis (redis://host:6379/0);"
        " unset: breakers are this sidecar's own.",
    )
    breaker_redis_required: bool = Field(
        default=False,
        description="Refuse to start when the breakers' Redis does not answer; otherwise the"
        " sidecar starts (and runs) with its own breaker state until Redis answers.",
    )
    breaker_redis_timeout_s: float = Field(
        default=0.25,
        gt=0,
        le=5,
        description="Longest wait for one Redis operation on breaker state.",
    )
    breaker_redis_retry_s: float = Field(
        default=5.0,
        ge=0.1,
        le=600,
        description="After a Redis error or timeout, how long breakers use local state"
        " before Redis is asked again.",
    )
    breaker_redis_namespace: str = Field(
        default="spanvisor",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Prefix of the breakers' Redis keys; sidecars that share breakers share it.",
    )
    remediation_database_url: str | None = Field(
        default=None,
        pattern=r"^(sqlite:///|postgresql(\+psycopg)?://)",
        description="Where remediation workflows are kept (DBOS): sqlite:///path or"
        " postgresql://...; unset: remediations.sqlite next to state_path.",
    )
    remediation_executor_id: str = Field(
        default="local",
        min_length=1,
        max_length=128,
        description="Unique per sidecar sharing one remediation database.",
    )
    max_active_remediations: int = Field(default=256, ge=1, le=100_000)
    notify_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="Escalations are posted here as Slack-compatible JSON, signed.",
    )
    notify_secret: str | None = Field(
        default=None, description="Signing secret for notify_url (Standard Webhooks)."
    )
    llm_base_url: str | None = Field(
        default=None, description="OpenAI-compatible endpoint for the llm remediator."
    )
    llm_model: str | None = Field(default=None, description="Model for the llm remediator.")
    max_pending_commands: int = Field(default=100_000, ge=1, le=10_000_000)
    retention_s: float = Field(default=7 * 86_400.0, ge=60, le=365 * 86_400)
    store_commit_interval_s: float = Field(
        default=0.01,
        ge=0,
        le=1.0,
        description="Least time between two store commits under load: failures judged"
        " meanwhile share one transaction (0: each batch commits at once).",
    )
    store_retain_failures: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="Judged failures kept in memory while the store refuses writes (a full"
        " disk), to be stored when it takes them; ingest throttles from half of it, and"
        " beyond it failures are dropped, counted.",
    )
    store_retain_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1024,
        le=16 * 1024**3,
        description="The same bound in bytes (the failures' incidents as JSON).",
    )
    policy_poll_s: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="Seconds between policy file checks; 0: only SIGHUP.",
    )

    drain_timeout_s: float = Field(default=10.0, gt=0, le=600)
    gc_full_interval_s: float = Field(
        default=60.0, ge=1, le=3600, description="Seconds between full garbage collections."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="after")
    def _fleet_remediations(self) -> Settings:
        """A fleet's remediations are shared too, or two sidecars would run one twice."""
        if (
            self.database_url
            and self.remediation_database_url
            and self.remediation_database_url.startswith("sqlite:")
        ):
            raise ValueError(
                "database_url shares incidents between sidecars, but remediation_database_url"
                f" {self.remediation_database_url} is this sidecar's own: set it to a"
                " postgresql:// URL too, or leave it unset to use database_url"
            )
        return self

    @model_validator(mode="after")
    def _heartbeats(self) -> Settings:
        """One late heartbeat must not make a sidecar dead: its work would be taken over."""
        if self.instance_dead_after_s <= 2 * self.instance_heartbeat_s:
            raise ValueError(
                f"instance_dead_after_s ({self.instance_dead_after_s:g} s) must be more than"
                f" twice instance_heartbeat_s ({self.instance_heartbeat_s:g} s): a sidecar"
                " that misses one heartbeat is not dead"
            )
        return self

    def instance(self) -> str:
        """This sidecar's name in the store's rows: ``instance_id``, else hostname:api_port."""
        return self.instance_id or f"{socket.gethostname()}:{self.api_port}"

    @field_validator("token_file", "policy", "state_path")
    @classmethod
    def _home(cls, path: Path | None) -> Path | None:
        """``~`` in a path setting means the user's home, as in a shell."""
        return Path(os.path.expanduser(path)) if path is not None else None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, ``SPANVISOR_*`` variables, the settings file of :func:`load_settings`."""
        return current_load().sources(settings_cls, init_settings)


def load_settings(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Build settings from a YAML file, the environment and explicit overrides.

    An override of None is no override: the CLI passes every flag, given or not.
    """
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    with loading(Path(path) if path is not None else None) as load:
        try:
            return Settings(**given)
        except ValidationError as exc:
            raise load.explain(exc) from exc
