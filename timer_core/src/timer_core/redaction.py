"""Connection URLs with their secrets hidden, for logs and error messages."""

from timer_core._redact import REDACTED, redact_url

__all__ = ["REDACTED", "redact_url"]
