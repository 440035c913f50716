"""vLLM's HTTP front-end flags of ``runtime serve`` (uvicorn, CORS, TLS, docs, request ids): accepted with vLLM's
spelling, defaults and meaning; a bad value refused before the model loads, the error naming it."""

from __future__ import annotations

import pytest

from runtime.cli import serve
from runtime.cli.main import build_parser
from runtime.entrypoints.openai.api_server import uvicorn_config
from support.tls_cert import self_signed_cert


def parse_serve(*argv: str):
    return build_parser(load_plugins=False).parse_args(["serve", "MODEL", *argv])


def test_defaults_match_vllm():
    args = parse_serve()
    assert args.uvicorn_log_level == "info"
    assert args.disable_uvicorn_access_log is False
    assert args.root_path is None
    assert (args.allowed_methods, args.allowed_headers, args.allow_credentials) == (["*"], ["*"], False)
    assert args.disable_fastapi_docs is False
    assert (args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs) == (None, None, None, 0)
    assert args.enable_request_id_headers is False
    config = uvicorn_config(None, args)
    assert (config.log_level, config.access_log, config.ssl_certfile) == ("info", True, None)


def test_vllm_command_line_values_are_taken():
    args = parse_serve(
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--root-path", "/api",
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", "content-type, authorization", "--allow-credentials",
        "--allowed-origins", "http://a.example", "--disable-fastapi-docs", "--enable-request-id-headers",
    )
    assert args.allowed_methods == ["GET", "POST"]
    assert args.allowed_headers == ["content-type", "authorization"]
    assert (args.root_path, args.allow_credentials, args.disable_fastapi_docs, args.enable_request_id_headers) == (
        "/api", True, True, True
    )
    serve.check_front_end_args(args)
    config = uvicorn_config(None, args)
    assert (config.log_level, config.access_log) == ("warning", False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--uvicorn-log-level", "loud"), "argument --uvicorn-log-level: invalid choice: 'loud'"),
        (("--allowed-methods", '["GET", "PO ST"]'), "argument --allowed-methods: 'PO ST' is not an HTTP method name"),
        (("--allowed-methods", '["GET"'), "argument --allowed-methods: not a valid JSON list"),
        (("--allowed-methods", '[]'), "argument --allowed-methods: must be a list of method names"),
        (("--allowed-headers", "content-type,"), "argument --allowed-headers: '' is not an HTTP header name"),
        (("--allowed-headers", '["x-a", 3]'), "argument --allowed-headers: 3 is not an HTTP header name"),
        (("--ssl-cert-reqs", "required"), "argument --ssl-cert-reqs: invalid int value: 'required'"),
    ],
)
def test_bad_values_are_refused_by_the_parser_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_serve(*argv)
    assert message in capsys.readouterr().err


def check(*argv: str) -> None:
    serve.check_front_end_args(parse_serve(*argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--root-path", "api"), "--root-path must be a URL path starting with '/', got 'api'"),
        (("--allowed-origins", "http://a.example, *", "--allow-credentials"),
         "--allow-credentials with --allowed-origins '*' would let any web site"),
        (("--ssl-keyfile", "key.pem"), "--ssl-keyfile key.pem needs --ssl-certfile"),
        (("--ssl-cert-reqs", "2"), "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
        (("--ssl-certfile", "/nonexistent/cert.pem"), "--ssl-certfile /nonexistent/cert.pem: no such file"),
    ],
)
def test_bad_combinations_are_refused_naming_the_flags(argv, message):
    with pytest.raises(ValueError) as error:
        check(*argv)
    assert message in str(error.value)


def test_tls_files_are_loaded_before_the_model(tmp_path):
    """A certificate that uvicorn cannot load fails at once with the file named, not after the model loaded."""
    cert, key = self_signed_cert(tmp_path)
    check("--ssl-certfile", cert, "--ssl-keyfile", key)
    check("--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", cert, "--ssl-cert-reqs", "2")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"--ssl-certfile {garbage} / --ssl-keyfile {key}: not a usable"):
        check("--ssl-certfile", str(garbage), "--ssl-keyfile", key)
    with pytest.raises(ValueError, match=f"--ssl-certfile {cert} / --ssl-keyfile {cert}: not a usable"):
        check("--ssl-certfile", cert, "--ssl-keyfile", cert)  # the certificate given as the key
    with pytest.raises(ValueError, match=f"--ssl-ca-certs {garbage}: not PEM CA certificates"):
        check("--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", str(garbage))
    with pytest.raises(ValueError, match="--ssl-cert-reqs must be 0 \\(none\\), 1 \\(optional\\) or 2"):
        check("--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "5")


def test_an_encrypted_key_is_refused_instead_of_prompting(tmp_path):
    """OpenSSL would ask for the pass phrase on the terminal (a service has none): refuse such a key."""
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    cert, key = self_signed_cert(tmp_path)
    private = serialization.load_pem_private_key(open(key, "rb").read(), password=None)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(ValueError, match="the key is encrypted; give an unencrypted key"):
        check("--ssl-certfile", cert, "--ssl-keyfile", str(encrypted))

