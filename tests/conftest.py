"""Without CUDA, Triton kernels run in its interpreter. The variable must be set before triton is first
imported (transformers imports it too), so it is set here, before any test module loads.

transformers' own GGUF loader on the default model is the independent reference of several test modules;
it takes about 20 s (model) and 7 s (tokenizer) on 2 cores, so each is loaded once per session."""

import datetime
import ipaddress
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _default_gguf() -> Path:
    from specwire.default_model import default_model_path  # after TRITON_INTERPRET is set

    return default_model_path()


@pytest.fixture(scope="session")
def hf_model() -> torch.nn.Module:
    """The default SmolLM2 GGUF as transformers loads it (fp32, eval). Shared: never move or cast it."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    from transformers import AutoModelForCausalLM

    path = _default_gguf()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The default SmolLM2 GGUF's tokenizer and chat template as transformers converts them."""
    from transformers import AutoTokenizer

    path = _default_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ---------------------------------------------------------------- certificates for TLS and mTLS tests


def _issue(name: str, issuer: tuple | None, *, ca: bool, server: bool = False) -> tuple:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer_cert.subject if issuer_cert else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()), key


def _write(directory: Path, name: str, cert_and_key: tuple) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization

    cert, key = cert_and_key
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(directory / f"{name}.crt"), str(directory / f"{name}.key")


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """A trusted CA with a server and a client cert, and a rogue CA with its own client cert (PEM files)."""
    pytest.importorskip("cryptography.x509", reason="cryptography is a test dependency")
    d = tmp_path_factory.mktemp("pki")
    ca = _issue("specwire test CA", None, ca=True)
    rogue = _issue("rogue CA", None, ca=True)
    return {
        "ca": _write(d, "ca", ca),
        "server": _write(d, "server", _issue("localhost", ca, ca=False, server=True)),
        "client": _write(d, "client", _issue("verifier", ca, ca=False)),
        "rogue_client": _write(d, "rogue_client", _issue("intruder", rogue, ca=False)),
    }
