"""The OTLP exporter variables, read as the OpenTelemetry specification defines them."""

from __future__ import annotations

import logging

import pytest

from supervisor.errors import ConfigError
from supervisor.forward.downstream import Downstream, downstream_from_env

E = "OTEL_EXPORTER_OTLP_ENDPOINT"
TE = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
P = "OTEL_EXPORTER_OTLP_PROTOCOL"
TP = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
H = "OTEL_EXPORTER_OTLP_HEADERS"
TH = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
T = "OTEL_EXPORTER_OTLP_TIMEOUT"
TT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
C = "OTEL_EXPORTER_OTLP_COMPRESSION"
TC = "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION"
I = "OTEL_EXPORTER_OTLP_INSECURE"  # noqa: E741  # the variable's own suffix
TI = "OTEL_EXPORTER_OTLP_TRACES_INSECURE"


def http(endpoint: str, **kw: object) -> Downstream:
    fields: dict[str, object] = {
        "endpoint": endpoint,
        "protocol": "http/protobuf",
        "headers": (),
        "timeout_s": 10.0,
        "insecure": endpoint.startswith("http://"),
        "compression": "none",
    }
    fields.update(kw)
    return Downstream(**fields)  # type: ignore[arg-type]


def grpc(endpoint: str, *, insecure: bool, **kw: object) -> Downstream:
    return http(endpoint, protocol="grpc", insecure=insecure, **kw)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, None, id="nothing-set"),
        pytest.param({E: "", TE: "  "}, None, id="empty-is-unset"),
        pytest.param({P: "grpc", H: "a=b"}, None, id="no-endpoint-no-downstream"),
        # HTTP: the base gets /v1/traces, the signal-specific URL is used as-is.
        pytest.param({E: "http://c:4318"}, http("http://c:4318/v1/traces"), id="base"),
        pytest.param({E: "http://c:4318/"}, http("http://c:4318/v1/traces"), id="base-slash"),
        pytest.param(
            {E: "https://c/otlp/"}, http("https://c/otlp/v1/traces", insecure=False), id="base-path"
        ),
        pytest.param({TE: "http://c:4318/custom"}, http("http://c:4318/custom"), id="signal-as-is"),
        pytest.param({TE: "http://c:4318"}, http("http://c:4318/"), id="signal-no-path-is-root"),
        pytest.param(
            {E: "http://base:4318", TE: "http://sig:9999/v1/traces"},
            http("http://sig:9999/v1/traces"),
            id="signal-wins",
        ),
        pytest.param({E: "http://c:4318", TE: ""}, http("http://c:4318/v1/traces"), id="empty-sig"),
        # Protocol.
        pytest.param(
            {E: "http://c:4317", P: "grpc"}, grpc("http://c:4317", insecure=True), id="grpc"
        ),
        pytest.param(
            {E: "https://c:4317", P: "GRPC", I: "true"},
            grpc("https://c:4317", insecure=False),
            id="grpc-https-scheme-wins-over-insecure",
        ),
        pytest.param(
            {E: "c:4317", TP: "grpc", P: "http/protobuf"},
            grpc("c:4317", insecure=False),
            id="grpc-bare-secure-by-default",
        ),
        pytest.param(
            {E: "c:4317", P: "grpc", TI: "TRUE", I: "false"},
            grpc("c:4317", insecure=True),
            id="grpc-bare-insecure-signal-wins",
        ),
        pytest.param(
            {TE: "c:4317", P: "grpc"}, grpc("c:4317", insecure=False), id="grpc-signal-as-is"
        ),
        pytest.param({E: "http://c", P: "http/json"}, http("http://c/v1/traces"), id="json-as-pb"),
        # Headers: baggage-style, percent-decoded, names lowercased, signal-specific replaces.
        pytest.param(
            {E: "http://c", H: "Api-Key=s%3Dcr%20et , x-b = 2,,"},
            http("http://c/v1/traces", headers=(("api-key", "s=cr et"), ("x-b", "2"))),
            id="headers",
        ),
        pytest.param(
            {E: "http://c", H: "a=1", TH: "b=2"},
            http("http://c/v1/traces", headers=(("b", "2"),)),
            id="headers-signal-replaces",
        ),
        pytest.param(
            {E: "http://c", H: "authorization=Bearer abc=="},
            http("http://c/v1/traces", headers=(("authorization", "Bearer abc=="),)),
            id="headers-unencoded-liberal",
        ),
        pytest.param(
            {E: "http://c", H: "k=caf%C3%A9"},
            http("http://c/v1/traces", headers=(("k", "café"),)),
            id="headers-utf8",
        ),
        # Timeout in milliseconds; compression.
        pytest.param(
            {E: "http://c", T: "2500"}, http("http://c/v1/traces", timeout_s=2.5), id="ms"
        ),
        pytest.param(
            {E: "http://c", T: "1000", TT: "250"},
            http("http://c/v1/traces", timeout_s=0.25),
            id="ms-signal-wins",
        ),
        pytest.param(
            {E: "http://c", C: "none", TC: "GZIP"},
            http("http://c/v1/traces", compression="gzip"),
            id="gzip",
        ),
    ],
)
def test_downstream_from_env(env: dict[str, str], expected: Downstream | None) -> None:
    assert expected == downstream_from_env(env)


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({E: "http://c", P: "thrift"}, P),
        ({E: "http://c", TP: "http"}, TP),
        ({E: "c:4318"}, E),  # HTTP needs a scheme
        ({TE: "ftp://c/v1/traces"}, TE),
        ({E: "http://c:notaport"}, E),
        ({E: "c 4317", P: "grpc"}, E),
        ({E: "unix://sock", P: "grpc"}, E),
        ({E: "http://c", T: "0"}, T),
        ({E: "http://c", T: "-5"}, T),
        ({E: "http://c", TT: "soon"}, TT),
        ({E: "http://c", T: "inf"}, T),
        ({E: "http://c", C: "deflate"}, C),
        ({E: "c:4317", P: "grpc", I: "yes"}, I),
        ({E: "http://c", H: "novalue"}, H),
        ({E: "http://c", TH: "bad name=1"}, TH),
        ({E: "http://c", H: "a=%0D%0Ainjected: 1"}, H),
        ({E: "http://c", H: "a=%ff"}, H),
    ],
)
def test_nonsense_raises_config_error_naming_the_variable(
    env: dict[str, str], variable: str
) -> None:
    with pytest.raises(ConfigError) as info:
        downstream_from_env(env)
    assert str(info.value).startswith(variable)


def test_header_errors_never_echo_the_secret_value() -> None:
    with pytest.raises(ConfigError) as info:
        downstream_from_env({E: "http://c", H: "api-key=s3cr3t%0A"})
    assert "s3cr3t" not in str(info.value)


def test_http_json_is_sent_as_protobuf_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="spanvisor.downstream"):
        got = downstream_from_env({E: "http://c", P: "http/json"})
    assert got is not None
    assert got.protocol == "http/protobuf"
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "http/json is sent as http/protobuf"
    ]


def test_unsupported_tls_files_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="spanvisor.downstream"):
        downstream_from_env({E: "https://c", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem"})
    assert [getattr(r, "variable", None) for r in caplog.records] == [
        "OTEL_EXPORTER_OTLP_CERTIFICATE"
    ]


@pytest.mark.parametrize(
    ("downstream", "url", "target", "plaintext"),
    [
        (http("http://c:4318"), "http://c:4318/v1/traces", "c:4318", True),
        (http("http://c:4318/"), "http://c:4318/", "c:4318", True),
        (http("https://c/x/v1/traces"), "https://c/x/v1/traces", "c", False),
        (grpc("c:4317", insecure=True), "", "c:4317", True),
        (grpc("c:4317", insecure=False), "", "c:4317", False),
        (grpc("http://c:4317", insecure=False), "", "c:4317", True),
        (grpc("https://[::1]:4317", insecure=True), "", "[::1]:4317", False),
    ],
)
def test_resolved_http_url_and_grpc_target(
    downstream: Downstream, url: str, target: str, plaintext: bool
) -> None:
    if downstream.protocol == "http/protobuf":
        assert url == downstream.http_url
    assert (target, plaintext) == (downstream.grpc_target, downstream.grpc_insecure)


@pytest.mark.parametrize(
    "fields",
    [
        {"protocol": "zipkin"},
        {"compression": "br"},
        {"timeout_s": 0},
        {"timeout_s": -1.0},
        {"timeout_s": float("nan")},
        {"endpoint": ""},
        {"endpoint": "c:4318"},
        {"headers": (("bad name", "v"),)},
        {"headers": (("k", "a\r\nb"),)},
    ],
)
def test_downstream_validates_its_fields(fields: dict[str, object]) -> None:
    endpoint = str(fields.pop("endpoint", "http://c:4318"))
    with pytest.raises(ConfigError):
        http(endpoint, **fields)


def test_header_dict_is_lowercase_and_later_wins() -> None:
    ds = http("http://c", headers=(("X-A", "1"), ("x-a", "2"), ("B", "3")))
    assert ds.header_dict == {"x-a": "2", "b": "3"}
