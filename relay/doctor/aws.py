"""What the AWS checks share: the clients they use (:class:`Clients`, built by the command
line), an AWS error's code and message, and a call that failed for a reason that says nothing
of the setting it was to check (:func:`unchecked`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relay.doctor.report import Check, Level, first_line

__all__ = ["NOT_FOUND", "Clients", "aws_error", "unchecked"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Clients:
    """The AWS clients the checks use, built by the command line."""

    ses: Callable[[], Any]  # the relay's own SES v2 client; may raise ConfigurationError
    aws: Callable[[str, str], Any]  # (service, region): SES v1, SNS, of boto3's same chain
    sqs: Callable[[str], Any]  # the intake's SQS client for a queue URL


def aws_error(exc: Exception) -> tuple[str, str]:
    """(code, message) of a botocore ``ClientError``, else the exception's name and text.
    A code of digits only is an HTTP status without an AWS error code: the endpoint does not
    know the call (an emulator)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return str(err.get("Code", "")), str(err.get("Message", "")).splitlines()[0][:200]
    return type(exc).__name__, first_line(exc)


_CREDENTIALS = frozenset(
    {
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "IncompleteSignature",
    }
)
_DENIED = frozenset({"AccessDenied", "AccessDeniedException"})
NOT_FOUND = frozenset({"NotFoundException", "ConfigurationSetDoesNotExist", "NotFound"})


def unchecked(name: str, call: str, exc: Exception, *, region: str) -> Check:
    """A call that failed for a reason that says nothing of the setting it was to check."""
    code, text = aws_error(exc)
    if code in _CREDENTIALS:
        return Check(
            check=name,
            status=Level.FAIL,
            found=f"SES in {region} refused the credentials ({code}: {text})",
            fix="give the relay valid AWS credentials (environment, profile or role)",
        )
    if code in _DENIED:
        return Check(
            check=name,
            status=Level.WARN,
            found=f"could not check: the credentials may not call {call} ({code})",
            fix=f"allow ses:{call} to check it (the relay itself needs only ses:SendEmail)",
        )
    if code.isdigit():
        return Check(
            check=name,
            status=Level.WARN,
            found=f"could not check: the endpoint does not answer {call} (HTTP {code}: an "
            "emulator?)",
        )
    return Check(check=name, status=Level.WARN, found=f"could not check: {call}: {code}: {text}")
